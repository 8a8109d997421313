"""`tokenmill serve --data-parallel-size 2`: concurrent clients through the official openai client, the
totals and the per-replica series in /metrics, every block free afterwards."""
from __future__ import annotations

import concurrent.futures
import os

import openai
import pytest

from tests.server.conftest import API_KEY, metric, wait_idle

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")


def test_two_replicas_behind_one_server(start_server, model_name):
    server = start_server("--api-key", API_KEY, "--data-parallel-size", "2", "--max-num-seqs", "32")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)

    def complete(i: int) -> int:
        out = client.completions.create(model=model_name, prompt=f"hello {i}", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(complete, range(24))) == [6] * 24
    values = wait_idle(server.url)
    assert metric(values, "tokenmill:num_requests_running") == 0
    assert metric(values, "tokenmill:kv_cache_usage_perc") == 0
    for replica in ("0", "1"):
        assert metric(values, "tokenmill:replica_up", replica=replica) == 1
    assert metric(values, "tokenmill:generation_tokens_total") >= 24 * 6
