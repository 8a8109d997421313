"""`tokenmill serve --speculative-config ...`: completions as without it, and vLLM's spec_decode_* counters
in /metrics under the server's prefix; usage counts every token of multi-token chunks."""
from __future__ import annotations

import httpx

from tests.server.conftest import API_KEY, metric, scrape


def test_speculation_behind_the_server(start_server, model_name):
    # a fixed k: the adaptive length may turn drafts off for a step whose timing says they do not pay
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}'
    server = start_server("--api-key", API_KEY, "--speculative-config", spec)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model_name, "prompt": "a b c a b c a b c a b c", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert 1 <= len(chunks) <= 21
    values = scrape(server.url)
    drafts = metric(values, "tokenmill:spec_decode_num_drafts_total")
    assert drafts > 0
    assert metric(values, "tokenmill:spec_decode_num_draft_tokens_total") >= \
        metric(values, "tokenmill:spec_decode_num_accepted_tokens_total") >= 0
