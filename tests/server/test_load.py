"""Concurrency, abandoned clients, a full queue (429) and graceful shutdown, on real server processes."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from .conftest import API_KEY, metric, scrape, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _body(max_tokens: int, i: int = 0, stream: bool = True) -> dict:
    return {"prompt": f"request {i} says", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}


def test_200_concurrent_streams_complete_and_free_every_block(server, model_name):
    num_requests, max_tokens = 200, 16

    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await ac.completions.create(model=model_name, prompt=f"client {i}:", max_tokens=max_tokens,
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run():
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=num_requests), timeout=120)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, http_client=http,
                                      max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(num_requests)))

    results = asyncio.run(run())
    assert len(results) == num_requests
    assert all(tokens == max_tokens and text for text, tokens in results)
    after = wait_idle(server.url)
    assert metric(after, "tokenmill:kv_cache_usage_perc") == 0
    assert metric(after, "tokenmill:num_requests_running") == 0


def test_abandoned_streams_free_their_blocks(server):
    num_clients = 50
    before = scrape(server.url)

    async def abandon(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", server.url + "/v1/completions", json=_body(400, i), headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            for _ in range(3):   # a few events, then hang up mid-stream
                await anext(lines)

    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=num_clients), timeout=60) as client:
            await asyncio.gather(*(abandon(client, i) for i in range(num_clients)))
    asyncio.run(run())
    after = wait_idle(server.url)
    assert metric(after, "tokenmill:kv_cache_usage_perc") == 0
    assert metric(after, "tokenmill:num_requests_running") == 0
    aborted = (metric(after, "tokenmill:request_success_total", finished_reason="abort")
               - metric(before, "tokenmill:request_success_total", finished_reason="abort"))
    assert aborted == num_clients


def test_abandoned_non_streaming_request_is_aborted(server):
    before = scrape(server.url)
    # 8 prompts x n=4 x 480 tokens: far more work than the client waits for, however fast the engine
    body = dict(_body(480, stream=False), prompt=[f"request {i} says" for i in range(8)], n=4)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    after = wait_idle(server.url)
    assert metric(after, "tokenmill:kv_cache_usage_perc") == 0
    assert (metric(after, "tokenmill:request_success_total", finished_reason="abort")
            - metric(before, "tokenmill:request_success_total", finished_reason="abort")) == 32


def _stream_in_thread(url: str, body: dict, results: list, started: threading.Event | None = None) -> threading.Thread:
    """Read one SSE stream to its end; appends (status, events or error text, Retry-After header)."""
    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    results.append((r.status_code, r.read().decode(), r.headers.get("retry-after")))
                    return
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if started is not None:
                            started.set()
                results.append((200, events, None))
        except httpx.HTTPError as e:
            results.append((None, repr(e), None))
    t = threading.Thread(target=run)
    t.start()
    return t


def test_full_queue_answers_429_with_retry_after(start_server):
    srv = start_server("--max-num-seqs", "2", "--max-waiting-requests", "1")
    results: list = []
    threads = [_stream_in_thread(srv.url, _body(200, i), results) for i in range(8)]
    for t in threads:
        t.join(60)
    statuses = sorted(r[0] for r in results)
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, results
    for status, body, retry_after in results:
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1
            assert json.loads(body)["error"]["code"] == "queue_full"
        else:
            assert body[-1] == "[DONE]"
    r = httpx.post(srv.url + "/v1/completions", json=_body(4, stream=False), timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/v1/completions", json=dict(_body(4, stream=False), n=4), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"   # can never fit: not a 429
    assert metric(wait_idle(srv.url), "tokenmill:kv_cache_usage_perc") == 0


def _finish_reasons(events: list[str]) -> list[str]:
    reasons = []
    for e in events:
        if e != "[DONE]":
            reasons += [c["finish_reason"] for c in json.loads(e)["choices"] if c["finish_reason"]]
    return reasons


def test_sigterm_finishes_in_flight_requests_then_exits(start_server):
    srv = start_server("--shutdown-grace-s", "30")
    results: list = []
    started = [threading.Event() for _ in range(4)]
    threads = [_stream_in_thread(srv.url, _body(120, i), results, started[i]) for i in range(4)]
    assert all(e.wait(30) for e in started)   # every stream is under way before the signal
    srv.signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.TransportError):   # no new connections while draining
        httpx.get(srv.url + "/health", timeout=2)
    for t in threads:
        t.join(60)
    assert srv.proc.wait(30) == 0, srv.log()
    assert len(results) == 4
    for status, events, _ in results:
        assert status == 200 and events[-1] == "[DONE]"
        assert _finish_reasons(events) == ["length"]
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 120


def test_sigterm_aborts_what_outlives_the_grace_time(start_server):
    srv = start_server("--shutdown-grace-s", "0.1")   # far shorter than 480 tokens take, however fast the engine
    results: list = []
    started = [threading.Event() for _ in range(4)]
    threads = [_stream_in_thread(srv.url, _body(480, i), results, started[i]) for i in range(4)]
    assert all(e.wait(30) for e in started)
    t0 = time.monotonic()
    srv.signal(signal.SIGINT)
    for t in threads:
        t.join(30)
    assert srv.proc.wait(30) == 0, srv.log()
    assert time.monotonic() - t0 < 10
    for status, events, _ in results:
        assert status == 200 and events[-1] == "[DONE]"
        assert _finish_reasons(events) in (["abort"], ["length"])
    assert any(_finish_reasons(e) == ["abort"] for _, e, _ in results)
