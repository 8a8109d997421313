"""A client that hangs up at any moment, or sends what the engine cannot compute, harms nobody: real sockets
against a real `tokenmill serve`; and when the engine loop does die, the server says so and exits non-zero."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from . import rawhttp
from .conftest import API_KEY, ServerProcess, metric, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CANARY = {"prompt": "the canary sings", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _canary(url: str) -> tuple[str, int]:
    r = httpx.post(url + "/v1/completions", json=CANARY, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_chat_stream_closed_after_its_first_chunk_leaves_the_engine_serving(server):
    """The reported case: the role chunk goes out before the request reaches the engine; hanging up then
    used to cancel the admission and kill the engine thread (every later request hung)."""
    alone = _canary(server.url)
    chat = _body(messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=400, stream=True)
    for _ in range(5):
        r = asyncio.run(rawhttp.request(server.port, "POST", "/v1/chat/completions", chat, AUTH, hangup="first-event"))
        assert r.status == 200 and len(r.events) >= 1
    assert _canary(server.url) == alone
    assert httpx.get(server.url + "/health").status_code == 200
    idle = wait_idle(server.url)
    assert metric(idle, "tokenmill:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_hanging_up_at_every_stage_is_an_ordinary_event(server, stream):
    alone = _canary(server.url)
    long_prompt = " ".join(["word"] * 300)        # a long prefill: the hang-up lands mid-prefill too
    bodies = {
        "completion": _body(prompt=long_prompt, max_tokens=150, ignore_eos=True, stream=stream),
        "chat": _body(messages=[{"role": "user", "content": long_prompt}], max_tokens=150, stream=stream),
    }

    async def run():
        calls = [rawhttp.request(server.port, "POST", path, body, AUTH, hangup=stage)
                 for stage in rawhttp.HANGUP_STAGES
                 for path, body in (("/v1/completions", bodies["completion"]),
                                    ("/v1/chat/completions", bodies["chat"]))
                 for _ in range(2)]
        return await asyncio.gather(*calls)
    for r in asyncio.run(run()):
        assert r.status in (None, 200), r
    assert _canary(server.url) == alone
    idle = wait_idle(server.url)
    assert metric(idle, "tokenmill:num_requests_running") == 0
    assert metric(idle, "tokenmill:kv_cache_usage_perc") == 0
    assert httpx.get(server.url + "/health").status_code == 200


def test_hanging_up_after_the_end_and_aborting_twice_are_harmless(server):
    body = _body(prompt="short", max_tokens=4, stream=True)
    for _ in range(3):
        r = asyncio.run(rawhttp.request(server.port, "POST", "/v1/completions", body, AUTH))
        assert r.status == 200 and r.events[-1] == "[DONE]"
    assert _canary(server.url)[1] == 8


BAD_PARAMS = [   # (fields, the param the 400 names)
    ({"temperature": 1e300}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 10**6}, "top_k"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(49152)), "min_tokens": 2}, "stop_token_ids"),   # over MAX_STOP_TOKEN_IDS
    ({"stop": ["x" * 1000] * 64}, "stop"),                                          # over MAX_STOP_CHARS_TOTAL
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fields,param", BAD_PARAMS, ids=[p for _, p in BAD_PARAMS])
def test_parameters_the_engine_cannot_compute_are_400_before_anything_streams(roomy_server, fields, param, stream):
    server = roomy_server
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(server.url + path, json={**base, "max_tokens": 4, "stream": stream, **fields}, headers=AUTH,
                       timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_one_bad_request_among_good_ones_harms_none(roomy_server):
    server = roomy_server
    alone = _canary(server.url)

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            good = [client.post(server.url + "/v1/completions", json=CANARY) for _ in range(6)]
            bad = [client.post(server.url + "/v1/completions", json={**CANARY, **fields}) for fields, _ in BAD_PARAMS]
            return await asyncio.gather(*good, *bad)
    results = asyncio.run(run())
    for r in results[:6]:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[0]
    assert all(r.status_code == 400 for r in results[6:])


SURROGATE = b"\\ud800"   # a JSON escape of a lone surrogate: valid JSON, not valid Unicode
UNICODE_CASES = [
    ("/v1/completions", b'{"prompt": "a' + SURROGATE + b'b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "' + SURROGATE + b'"], "max_tokens": 2}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "ok", "stop": ["' + SURROGATE + b'"], "max_tokens": 2}', "stop.0"),
    ("/v1/completions", b'{"prompt": "ok", "model": "' + SURROGATE + b'"}', "model"),
    ("/v1/completions", b'{"prompt": "ok", "extra_' + SURROGATE + b'": 1}', "extra_\\ud800"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + SURROGATE + b'"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "'
     + SURROGATE + b'"}]}]}', "messages.0.content.0.text"),
    ("/tokenize", b'{"prompt": "' + SURROGATE + b'"}', "prompt"),
]


@pytest.mark.parametrize("path,body,param", UNICODE_CASES, ids=[c[2] for c in UNICODE_CASES])
def test_text_that_is_not_unicode_is_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_unicode" and "Unicode" in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]},
     "messages.1.content"),
], ids=["unknown-role", "user-without-content", "user-content-null"])
def test_chat_messages_are_checked_like_openai_does(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(roomy_server):
    r = httpx.post(roomy_server.url + "/v1/completions", json={"prompt": "1" * 7_000_000, "max_tokens": 1},
                   headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "bytes" in r.json()["error"]["message"]


def test_tokenizing_a_huge_text_does_not_stall_other_clients(roomy_server):
    """/tokenize of megabytes takes seconds, in a worker thread: a /health sent meanwhile is answered at once,
    not after it (it waited for all of it when tokenizing ran on the event loop)."""
    async def run():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            start = time.perf_counter()
            tokenize = asyncio.ensure_future(client.post(roomy_server.url + "/tokenize",
                                                         json={"prompt": "12 " * 2_000_000}))
            await asyncio.sleep(3.0)               # the body is in and tokenizing has begun
            sent = time.perf_counter()
            health = await client.get(roomy_server.url + "/health")
            health_s = time.perf_counter() - sent
            assert (await tokenize).status_code == 200 and health.status_code == 200
            return health_s, time.perf_counter() - start
    health_s, tokenize_s = asyncio.run(run())
    assert health_s < tokenize_s / 4, (health_s, tokenize_s)


def test_a_request_may_not_replace_the_chat_template(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.chat_template", r.text


def test_trailing_slash_is_a_404_not_a_redirect(server):
    r = httpx.post(server.url + "/v1/completions/", json={"prompt": "x"}, headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# ---- a loop that dies -----------------------------------------------------------------------------
KILLER_PROMPT = [7] * 33     # token ids; the patched scheduler below raises when it sees them waiting

# steps take at least 10 ms, so the victim's 400 tokens last 4 s whatever the machine's speed (the tiny model
# alone ran them in under the 0.5 s before the killer comes, on a fast machine)
DYING_SERVER = f"""
import sys
import time
from tokenmill.core import scheduler

real = scheduler.Scheduler.schedule

def schedule(self):
    if any(list(r.prompt_token_ids) == {KILLER_PROMPT!r} for r in self.waiting):
        raise RuntimeError("injected scheduler bug")
    if self.running:
        time.sleep(0.01)
    return real(self)

scheduler.Scheduler.schedule = schedule
from tokenmill.server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_ends_every_request_and_the_server_exits_non_zero(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, str(tmp_path / "server.log"), python_code=DYING_SERVER)
    try:
        async def run():
            victim = asyncio.ensure_future(rawhttp.request(srv.port, "POST", "/v1/completions", _body(
                prompt="a long one", max_tokens=400, ignore_eos=True, stream=True)))
            await asyncio.sleep(0.5)
            killer = await rawhttp.request(srv.port, "POST", "/v1/completions", _body(prompt=KILLER_PROMPT,
                                                                                      max_tokens=4))
            return await victim, killer
        victim, killer = asyncio.run(run())
        assert killer.status == 503 and killer.json()["error"]["code"] == "engine_dead", killer
        assert victim.status == 200 and any('"engine_dead"' in e for e in victim.events), victim.events[-3:]
        assert victim.events[-1] == "[DONE]"
        assert srv.proc.wait(30) == 1
        assert "injected scheduler bug" in srv.log()
    finally:
        srv.stop()


def test_a_dead_engine_is_unhealthy_and_counted(tiny_model_dir, monkeypatch):
    """In process, so /health and /metrics can be read between the death and the exit."""
    from fastapi.testclient import TestClient

    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.api_server import build_app
    from tokenmill.server.config import ServerConfig

    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, num_threads=1))
    try:
        client = TestClient(build_app(engine, ServerConfig(), max_num_seqs=8))
        assert client.get("/health").status_code == 200
        assert "tokenmill:engine_dead" in client.get("/metrics").text
        monkeypatch.setattr(engine.engine.core.scheduler, "schedule", lambda: 1 / 0)
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "ZeroDivisionError" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert 'tokenmill:engine_dead{model_name="' in client.get("/metrics").text
        assert [line for line in client.get("/metrics").text.splitlines()
                if line.startswith("tokenmill:engine_dead{")][0].endswith(" 1.0")
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
    finally:
        engine.shutdown()
