"""The OpenAI-compatible endpoints through the official `openai` client (sync and async, streaming and not)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .conftest import API_KEY, metric, scrape, wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog and"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def _tokenize(server, **body) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_health_version(server, client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_usage_counts(server, client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len(_tokenize(server, prompt=PROMPT))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_equals_non_stream(client, model_name):
    kwargs = dict(prompt=PROMPT, max_tokens=20, temperature=0.9, seed=1234, extra_body={"ignore_eos": True})
    full = client.completions.create(model=model_name, **kwargs)
    chunks = list(client.completions.create(model=model_name, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream_async(server, model_name):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as ac:
            kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0.7, seed=7)
            full = await ac.chat.completions.create(**kwargs)
            stream = await ac.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                      **kwargs)
            chunks = [c async for c in stream]
            return full, chunks
    full, chunks = asyncio.run(run())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.prompt_tokens == len(_tokenize(server, messages=MESSAGES))


def test_chat_sync_usage(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_multiple_prompts_and_n(client, model_name):
    r = client.completions.create(model=model_name, prompt=["one two", "three four five"], n=2, max_tokens=4,
                                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    chunks = list(client.completions.create(model=model_name, prompt=["one two", "three four five"], n=2, max_tokens=4,
                                            temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = {i: "" for i in range(4)}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_token_id_prompts(server, client, model_name):
    ids = _tokenize(server, prompt=PROMPT)
    by_ids = client.completions.create(model=model_name, prompt=[ids, ids[:3]], max_tokens=6, temperature=0)
    by_text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) + 3


def test_echo(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def test_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) >= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


def test_stop_string(client, model_name):
    base = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    expected = base[:base.index(stop)]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_tokenize_detokenize(server, auth, model_name):
    ids = _tokenize(server, prompt="hello world")
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=auth)
    assert r.json()["prompt"] == "hello world"


def test_metrics_move(server, client, model_name):
    before = wait_idle(server.url)
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server.url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)
    assert delta("tokenmill:generation_tokens_total") == 7
    assert delta("tokenmill:prompt_tokens_total") == len(_tokenize(server, prompt=PROMPT))
    assert delta("tokenmill:request_success_total", finished_reason="length") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta(f"tokenmill:{h}_count") == 1, h
    assert delta("tokenmill:inter_token_latency_seconds_count") == 6
    assert delta("tokenmill:prefix_cache_queries_total") > 0
    for name in ("num_preemptions_total", "prefix_cache_hits_total", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"tokenmill:{name}" in {k.partition("{")[0] for k in after}, name


def test_metrics_gauges_while_running(server, client, model_name):
    stream = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})   # long enough to still run while scraped
    next(iter(stream))
    during = scrape(server.url)
    stream.close()
    assert metric(during, "tokenmill:num_requests_running") >= 1
    assert metric(during, "tokenmill:kv_cache_usage_perc") > 0
    after = wait_idle(server.url)
    assert metric(after, "tokenmill:kv_cache_usage_perc") == 0


OPENAI_NULLABLE = ["model", "n", "stream", "stream_options", "temperature", "top_p", "presence_penalty",
                   "frequency_penalty", "seed", "stop", "user", "logit_bias", "logprobs"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **dict.fromkeys(
        OPENAI_NULLABLE + ["echo", "best_of", "suffix"])}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **dict.fromkeys(
        OPENAI_NULLABLE + ["top_logprobs", "max_completion_tokens", "response_format", "tools"])}),
], ids=["completions", "chat"])
def test_explicit_nulls_mean_the_defaults(server, auth, path, body):
    """OpenAI types these fields "... or null" (and vLLM reads null as the default)."""
    r = httpx.post(server.url + path, json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    streamed = httpx.post(server.url + path, json={**body, "stream": True, "stream_options": {"include_usage": None}},
                          headers=auth, timeout=60)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    assert '"usage":{' not in streamed.text       # include_usage null: its default, false


def test_max_tokens_null_gives_each_prompt_its_own_room(server, client, model_name):
    """Several prompts and max_tokens null: each may fill what its prompt leaves of the context window."""
    context = client.models.list().data[0].max_model_len
    lengths = (context - 12, context - 112)
    r = client.completions.create(model=model_name, prompt=[[7] * n for n in lengths], max_tokens=None,
                                  temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    assert [len(c.logprobs.tokens) for c in r.choices] == [12, 112]
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert r.usage.completion_tokens == 124
