"""Every client mistake gets the right status and an OpenAI-shaped error, and never harms the server."""
from __future__ import annotations

import httpx
import pytest

from tokenmill.sampling_params import (MAX_STOP_CHARS_TOTAL, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                      MAX_STOP_TOKEN_IDS)

from .conftest import API_KEY, MAX_BODY_BYTES, MAX_LOGPROBS, MAX_N

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _c(**fields):
    return {"prompt": "hello", "max_tokens": 4, **fields}


def _chat(**fields):
    return {"messages": MSGS, "max_tokens": 4, **fields}


# (id, method, path, json body or raw bytes, headers, status, expected param or None, text in the message)
CASES = [
    ("malformed-json", "POST", CMPL, b'{"prompt": "x",', AUTH, 400, None, "not valid JSON"),
    ("body-not-object", "POST", CMPL, [1, 2], AUTH, 400, None, "JSON object"),
    ("empty-body", "POST", CMPL, b"", AUTH, 400, None, "required"),
    ("missing-prompt", "POST", CMPL, {"max_tokens": 3}, AUTH, 400, "prompt", "missing"),
    ("missing-messages", "POST", CHAT, {"max_tokens": 3}, AUTH, 400, "messages", "missing"),
    ("empty-messages", "POST", CHAT, _chat(messages=[]), AUTH, 400, "messages", None),
    ("max-tokens-string", "POST", CMPL, _c(max_tokens="5"), AUTH, 400, "max_tokens", "integer"),
    ("max-tokens-bool", "POST", CMPL, _c(max_tokens=True), AUTH, 400, "max_tokens", None),
    ("temperature-string", "POST", CMPL, _c(temperature="hot"), AUTH, 400, "temperature", None),
    ("prompt-wrong-type", "POST", CMPL, _c(prompt=5), AUTH, 400, "prompt", None),
    ("stream-wrong-type", "POST", CHAT, _chat(stream="yes"), AUTH, 400, "stream", None),
    ("max-tokens-zero", "POST", CMPL, _c(max_tokens=0), AUTH, 400, "max_tokens", ">= 1"),
    ("max-tokens-negative", "POST", CHAT, _chat(max_tokens=-3), AUTH, 400, "max_tokens", None),
    ("temperature-negative", "POST", CMPL, _c(temperature=-0.5), AUTH, 400, "temperature", None),
    ("top-p-zero", "POST", CMPL, _c(top_p=0), AUTH, 400, "top_p", "(0, 1]"),
    ("top-p-above-one", "POST", CHAT, _chat(top_p=1.5), AUTH, 400, "top_p", None),
    ("n-zero", "POST", CMPL, _c(n=0), AUTH, 400, "n", None),
    ("n-above-limit", "POST", CMPL, _c(n=MAX_N + 1), AUTH, 400, "n", str(MAX_N)),
    ("logprobs-above-limit", "POST", CMPL, _c(logprobs=MAX_LOGPROBS + 1), AUTH, 400, "logprobs", None),
    ("top-logprobs-above-limit", "POST", CHAT, _chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), AUTH, 400,
     "top_logprobs", None),
    ("stop-empty-string", "POST", CMPL, _c(stop=""), AUTH, 400, "stop", None),
    ("stop-wrong-type", "POST", CMPL, _c(stop=[1, 2]), AUTH, 400, "stop", None),
    ("stop-too-many", "POST", CMPL, _c(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)]), AUTH, 400, "stop",
     f"at most {MAX_STOP_STRINGS} stop strings"),
    ("stop-too-long", "POST", CHAT, _chat(stop="x" * (MAX_STOP_STRING_CHARS + 1)), AUTH, 400, "stop",
     f"at most {MAX_STOP_STRING_CHARS} characters each"),
    ("stop-too-long-in-all", "POST", CMPL, _c(stop=["x" * MAX_STOP_STRING_CHARS] * 5), AUTH, 400, "stop",
     f"at most {MAX_STOP_CHARS_TOTAL} characters in all"),
    ("stop-token-ids-too-many", "POST", CHAT, _chat(stop_token_ids=[0] * (MAX_STOP_TOKEN_IDS + 1)), AUTH, 400,
     "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids"),
    ("stream-options-without-stream", "POST", CMPL, _c(stream_options={"include_usage": True}), AUTH, 400,
     "stream_options", "stream is true"),
    ("stream-options-with-stream-false", "POST", CHAT, _chat(stream=False, stream_options={}), AUTH, 400,
     "stream_options", "stream is true"),
    ("context-exceeded", "POST", CMPL, _c(max_tokens=600), AUTH, 400, "max_tokens", "512"),
    ("chat-context-exceeded", "POST", CHAT, _chat(max_tokens=100000), AUTH, 400, "max_tokens", "512"),
    ("prompt-too-long", "POST", CMPL, _c(prompt=[1] * 512, max_tokens=None), AUTH, 400, "prompt", "512"),
    ("token-out-of-vocab", "POST", CMPL, _c(prompt=[1, 10**9]), AUTH, 400, "prompt", "vocabulary"),
    ("empty-prompt-list", "POST", CMPL, _c(prompt=[]), AUTH, 400, "prompt", None),
    ("image-content", "POST", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     AUTH, 400, "messages.0.content", None),
    ("min-tokens-above-max", "POST", CMPL, _c(min_tokens=9, max_tokens=3), AUTH, 400, "min_tokens", "9"),
    ("penalty-out-of-range", "POST", CMPL, _c(presence_penalty=3), AUTH, 400, "presence_penalty", None),
    ("no-api-key", "POST", CMPL, _c(), {}, 401, None, "API key"),
    ("wrong-api-key", "POST", CHAT, _chat(), {"Authorization": "Bearer nope"}, 401, None, "API key"),
    ("no-key-on-models", "GET", "/v1/models", None, {}, 401, None, None),
    ("unknown-model", "POST", CMPL, _c(model="gpt-9"), AUTH, 404, "model", "gpt-9"),
    ("unknown-model-chat", "POST", CHAT, _chat(model="gpt-9"), AUTH, 404, "model", None),
    ("unknown-route", "GET", "/v2/nothing", None, AUTH, 404, None, "/v2/nothing"),
    ("wrong-method", "GET", CMPL, None, AUTH, 405, None, None),
    ("oversized-body", "POST", CMPL, _c(prompt="x" * (MAX_BODY_BYTES + 1)), AUTH, 413, None, str(MAX_BODY_BYTES)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_error_table(server, case):
    _, method, path, body, headers, status, param, text = case
    kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    r = httpx.request(method, server.url + path, headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if text is not None:
        assert text in err["message"], err


def test_oversized_chunked_body(server):
    """No Content-Length: the limit still holds while the body streams in."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'
    r = httpx.post(server.url + CMPL, content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_open_endpoints_need_no_key(server):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path


def test_server_still_serves_after_errors(server):
    r = httpx.post(server.url + CMPL, json=_c(), headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_a_response_sent_before_the_body_was_read_still_arrives(server):
    """401 and 405 are answered without parsing the body: its unread rest is drained first, else closing the
    connection on unread bytes resets it and the client sees a reset instead of the response."""
    import asyncio
    import json

    from . import rawhttp
    body = json.dumps({"prompt": "x" * 60000}).encode()
    for method, path, headers, status in (("POST", CMPL, {}, 401), ("DELETE", "/health", AUTH, 405)):
        r = asyncio.run(rawhttp.request(server.port, method, path, body, headers, trickle_s=0.02))
        assert r.status == status and r.json()["error"]["message"]
