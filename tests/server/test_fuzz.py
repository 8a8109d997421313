"""Fuzz: a seeded mix of a few hundred adversarial requests and valid canaries against a real server.

Adversarial: wrong types and extreme numbers in every field, NaN/Infinity literals, unknown fields,
broken bodies and encodings, odd chat parts, huge stop lists, text that is not Unicode, odd routes, clients
that hang up at every stage, slow senders and readers. Asserted: no 5xx (nor a server error inside a 200
stream), no hang, every 4xx carries a message, every canary gets 200 with the text it gets alone,
/health is truthful, and afterwards nothing runs and no KV block is in use.

TOKENMILL_FUZZ_SEED and TOKENMILL_FUZZ_CASES pick another seed and size (an independent run)."""
from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass

import httpx

from . import rawhttp
from .conftest import API_KEY, metric, wait_idle

SEED = int(os.environ.get("TOKENMILL_FUZZ_SEED", "20261201"))
NUM_CASES = int(os.environ.get("TOKENMILL_FUZZ_CASES", "480"))
CONCURRENCY = 24
REQUEST_TIMEOUT_S = 90      # far above any legitimate request here: reaching it is a hang
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CANARIES = ["canary one:", "the second canary", "canary three says"]
CANARY_EVERY = 8            # one case in CANARY_EVERY is a canary

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
          "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
          "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
          "stream", "stream_options", "logit_bias", "user", "logprobs", "top_logprobs", "echo", "best_of",
          "suffix", "add_generation_prompt", "chat_template_kwargs", "tools", "response_format",
          "ttft_target_ms", "tpot_target_ms", "no_such_field", "max_tokens_", ""]
EXTREMES = [None, True, False, 0, -1, 1, 2, 3, 7, 16, 17, 511, 512, 2**31, 2**53 + 1, 2**63, 2**64, -2**63, 10**30,
            1e308, -1e308, 1e-320, 5e-324, 0.5, -0.0, 1.0000001, 2.0, 2.0000001, "", "x", "5", "\x00", "\u202e",
            "🙂" * 40, "x" * 5000, [], [0], [1, 2, 3], [-1], [2**63], ["a"], ["", "b"], [[1]], [None], {}, {"a": 1},
            {"type": "text"}, {"include_usage": True}, {"include_usage": "yes"}, list(range(300)),
            ["stop"] * 50, [{"type": "text", "text": "hi"}], {"tokenize": True}, {"return_dict": True},
            {"continue_final_message": True}, {"messages": []}]
RAW_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 400, b"-0", b"0.0000000001e-400"]
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/v1/completions"), ("PUT", "/v1/completions"),
          ("POST", "/v1/completions/"), ("POST", "/v1/chat"), ("DELETE", "/health"), ("POST", "/metrics"),
          ("GET", "/v1/models/x"), ("POST", "/v1/completions?x=%ff%fe"), ("POST", "/v1/%ED%A0%80")]


@dataclass
class Case:
    kind: str
    method: str
    path: str
    body: bytes | None
    headers: dict
    hangup: str | None = None
    trickle_s: float = 0.0
    read_delay_s: float = 0.0
    canary: str | None = None


def _valid(rng: random.Random, chat: bool) -> dict:
    body = {"max_tokens": rng.choice([1, 4, 16, 64]), "temperature": rng.choice([0, 0.7, 1.0]),
            "stream": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "tell me a story", "résumé 🙂"])}]
    else:
        body["prompt"] = rng.choice(["hello", "once upon a time", ["a", "b"], [1, 2, 3]])
    return body


def _dumps(body) -> bytes:
    return json.dumps(body).encode()     # ASCII: every non-ASCII character as a JSON escape


def field_case(rng: random.Random) -> Case:
    chat = rng.random() < 0.5
    body = _valid(rng, chat)
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(FIELDS)] = rng.choice(EXTREMES)
    return Case("fields", "POST", "/v1/chat/completions" if chat else "/v1/completions", _dumps(body), AUTH)


def raw_number_case(rng: random.Random) -> Case:
    field = rng.choice(["temperature", "top_p", "max_tokens", "n", "seed", "presence_penalty", "min_p", "top_k"])
    body = b'{"prompt": "x", "max_tokens": 4, "' + field.encode() + b'": ' + rng.choice(RAW_NUMBERS) + b"}"
    return Case("raw-number", "POST", "/v1/completions", body, AUTH)


def broken_body_case(rng: random.Random) -> Case:
    good = _dumps(_valid(rng, rng.random() < 0.5))
    body = rng.choice([
        good[: rng.randint(0, len(good) - 1)], b"", b"null", b"[]", b'"text"', b"42", b"{}", b"{,}",
        b"\xff\xfe" + good, b"\xef\xbb\xbf" + good, good.replace(b'"', b"'"), b"[" * 20000 + b"]" * 20000,
        b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', b'{"prompt": "a", "prompt": 3}', good + b"garbage",
        good.decode().encode("utf-16"), bytes(rng.randrange(256) for _ in range(200)),
        b'{"prompt": "a", "max_tokens": 2, "stop": [' + b'"s",' * 3000 + b'"s"]}',
        b'{"messages": {"role": "user"}}', b'{"messages": ["hi"]}', b'{"messages": [[]]}'])
    return Case("broken-body", "POST", rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
                body, AUTH)


def header_case(rng: random.Random) -> Case:
    body = _dumps(_valid(rng, False))
    headers = dict(AUTH)
    headers.update(rng.choice([{"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                               {"Content-Type": "application/json; charset=latin-1"}, {"Content-Encoding": "gzip"},
                               {"Content-Type": None}, {"Authorization": "Bearer wrong"}, {"Authorization": None},
                               {"Transfer-Encoding": "chunked"},
                               {"Expect": "100-continue"}, {"Accept": "text/event-stream"}]))
    if headers.get("Transfer-Encoding") == "chunked":
        headers["Content-Length"] = None
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    return Case("headers", "POST", "/v1/completions", body, headers)


def chat_case(rng: random.Random) -> Case:
    part = rng.choice([{"type": "text", "text": "hi"}, {"type": "text"}, {"type": "image_url", "image_url": {}},
                       {"text": "no type"}, {"type": "text", "text": 5}, {"type": None}, "a bare string", 7,
                       {"type": "text", "text": "x" * 3000}])
    message = rng.choice([
        {"role": "user", "content": [part, part]}, {"role": rng.choice(["", "robot", "USER", "tool", "developer"]),
                                                    "content": "hi"},
        {"role": "assistant"}, {"role": "user", "content": "hi", "name": "bob", "tool_calls": [{}]},
        {"role": "user", "content": {"text": "hi"}}, {"content": "no role"}, {"role": 3, "content": "hi"},
        {"role": "user", "content": ""}, {"role": "system", "content": "s"}])
    messages = rng.choice([[message], [message] * 50, [{"role": "system", "content": "be brief"}, message]])
    body = {"messages": messages, "max_tokens": rng.choice([2, 8]), "stream": rng.random() < 0.5}
    return Case("chat", "POST", "/v1/chat/completions", _dumps(body), AUTH)


def stop_case(rng: random.Random) -> Case:
    stops = rng.choice([["x" * 40000], [str(i) for i in range(4000)], ["a"] * 2000, ["🙂", "\n", " "] * 300,
                        [chr(rng.randrange(32, 0x2FFF)) * rng.randint(1, 30) for _ in range(500)]])
    body = dict(_valid(rng, rng.random() < 0.5), stop=stops, max_tokens=rng.choice([8, 32]))
    if rng.random() < 0.5:
        body["stop_token_ids"] = rng.sample(range(49152), rng.choice([1, 100, 5000]))
        body["min_tokens"] = rng.choice([0, 1, 4])
    return Case("stops", "POST", "/v1/chat/completions" if "messages" in body else "/v1/completions",
                _dumps(body), AUTH)


def unicode_case(rng: random.Random) -> Case:
    chat = rng.random() < 0.5
    body = _dumps(_valid(rng, chat))
    body = body.replace(b'"hi"', b'"h\\udc00i"').replace(b'"hello"', b'"\\ud83d"').replace(b'"a"', b'"\\udfff"')
    if b"\\ud" not in body:
        body = body[:-1] + b', "user": "\\ud800x"}'
    return Case("unicode", "POST", "/v1/chat/completions" if chat else "/v1/completions", body, AUTH)


def route_case(rng: random.Random) -> Case:
    method, path = rng.choice(ROUTES)
    body = rng.choice([None, b"{}", _dumps({"prompt": "x"}), _dumps({"tokens": rng.choice(EXTREMES)}),
                       _dumps({"tokens": [0, 49151, 49152]}), _dumps({"prompt": "x", "messages": []})])
    return Case("route", method, path, body if method != "GET" else None, AUTH)


def hangup_case(rng: random.Random) -> Case:
    chat = rng.random() < 0.5
    body = dict(_valid(rng, chat), max_tokens=rng.choice([16, 200, 400]), ignore_eos=True)
    if rng.random() < 0.3:
        body["prompt" if not chat else "messages"] = (" ".join(["long"] * 300) if not chat else
                                                      [{"role": "user", "content": " ".join(["long"] * 300)}])
    body["n"] = rng.choice([1, 1, 3])
    return Case("hangup", "POST", "/v1/chat/completions" if chat else "/v1/completions", _dumps(body), AUTH,
                hangup=rng.choice(rawhttp.HANGUP_STAGES))


def slow_case(rng: random.Random) -> Case:
    body = dict(_valid(rng, rng.random() < 0.5), max_tokens=16, stream=True)
    return Case("slow", "POST", "/v1/chat/completions" if "messages" in body else "/v1/completions", _dumps(body),
                AUTH, trickle_s=rng.choice([0.0, 0.05, 0.2]), read_delay_s=rng.choice([0.0, 0.02, 0.1]))


GENERATORS = [field_case] * 6 + [raw_number_case, broken_body_case, broken_body_case, header_case, chat_case,
                                 chat_case, stop_case, unicode_case, route_case, hangup_case, hangup_case, slow_case]


def canary_case(prompt: str) -> Case:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return Case("canary", "POST", "/v1/completions", _dumps(body), AUTH, canary=prompt)


def make_cases(seed: int, num_cases: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(num_cases):
        if i % CANARY_EVERY == 0:
            cases.append(canary_case(CANARIES[(i // CANARY_EVERY) % len(CANARIES)]))
        else:
            cases.append(rng.choice(GENERATORS)(rng))
    return cases


def check(case: Case, r: rawhttp.RawResponse | BaseException, expected: dict[str, str]) -> str | None:
    """What is wrong with one response, or None."""
    if isinstance(r, BaseException):
        return f"no response: {type(r).__name__}: {r}"
    if r.status is None:
        return None if case.hangup else "no status line"
    if r.status >= 500:
        return f"status {r.status}: {r.body[:300]!r}"
    if case.hangup in ("status-line", "first-event", "mid-stream"):
        return None
    if 400 <= r.status < 500:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{r.status} without an OpenAI error body: {r.body[:300]!r}"
        return None if isinstance(message, str) and message else f"{r.status} with an empty message"
    if b'"server_error"' in r.body:
        return f"a server error inside a {r.status} response: {r.body[-300:]!r}"
    if case.canary is not None and r.json()["choices"][0]["text"] != expected[case.canary]:
        return f"canary {case.canary!r} got {r.json()['choices'][0]['text']!r}, alone {expected[case.canary]!r}"
    return None


async def run_all(port: int, cases: list[Case]) -> list:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(case: Case):
        async with gate:
            return await rawhttp.request(port, case.method, case.path, case.body, case.headers, hangup=case.hangup,
                                         trickle_s=case.trickle_s, read_delay_s=case.read_delay_s,
                                         timeout_s=REQUEST_TIMEOUT_S)
    return await asyncio.gather(*(one(c) for c in cases), return_exceptions=True)


def test_fuzz_no_5xx_no_hang_no_harmed_canary(roomy_server):
    server = roomy_server
    expected = {}
    for prompt in CANARIES:
        r = httpx.post(server.url + "/v1/completions", content=canary_case(prompt).body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        expected[prompt] = r.json()["choices"][0]["text"]
    cases = make_cases(SEED, NUM_CASES)
    results = asyncio.run(run_all(server.port, cases))
    problems = [(c.kind, c.method, c.path, (c.body or b"")[:200], problem) for c, r in zip(cases, results)
                if (problem := check(c, r, expected)) is not None]
    assert not problems, f"{len(problems)} of {len(cases)} cases went wrong (seed {SEED}):\n" + \
        "\n".join(map(repr, problems[:20]))
    assert sum(c.canary is not None for c in cases) >= NUM_CASES // CANARY_EVERY
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    idle = wait_idle(server.url, timeout_s=60)
    assert metric(idle, "tokenmill:num_requests_running") == 0
    assert metric(idle, "tokenmill:num_requests_waiting") == 0
    assert metric(idle, "tokenmill:kv_cache_usage_perc") == 0
    assert metric(idle, "tokenmill:engine_dead") == 0
