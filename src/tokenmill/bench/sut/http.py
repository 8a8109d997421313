"""SUT for any OpenAI-compatible `/v1/completions` endpoint, streamed (server-sent events).

Token counts come from the server's `usage` (requested with `stream_options.include_usage`) or, when
the server sends none, from re-tokenizing the text with a tokenizer the user gave; never from the
number of chunks (one chunk can carry several tokens). `ignore_eos` / `min_tokens` (vLLM extras) are
sent only when a sample asks for them.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator
from urllib.parse import urlsplit

import httpx

from tokenmill.bench.records import RequestRecord, Sample
from tokenmill.bench.sut.base import SUT, Clock, FirstTokenHook
from tokenmill.bench.sut.raw_http import HttpStatusError, RawHttpClient, StreamDropped


# Finish reasons of a stream that ended without the output it asked for: tokenmill's server ends its in-flight
# requests with "abort" when it shuts down, and "error" when their step failed.
UNFINISHED_FINISH_REASONS = ("abort", "error")


def unfinished_output(sample: Sample, record: RequestRecord) -> str | None:
    """Why a stream that ended cleanly still failed (None: it did not): an abort/error finish reason, or
    fewer output tokens than the sample's min_output_tokens (the min_tokens sent; MLPerf forbids truncating
    the output). Above that minimum an early stop is EOS and legitimate (cnndm: min 1)."""
    if record.finish_reason in UNFINISHED_FINISH_REASONS:
        return f"stream ended with finish_reason {record.finish_reason!r}"
    if (record.num_output_tokens or 0) < sample.min_output_tokens:
        return (f"output truncated: fewer tokens than min_tokens {sample.min_output_tokens} "
                f"(finish_reason {record.finish_reason!r})")
    return None


@dataclass(frozen=True)
class HttpConfig:
    base_url: str                       # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None            # served model name; None: the first of GET /v1/models
    api_key: str | None = None
    temperature: float = 0.0            # 0: greedy
    connect_timeout_s: float = 10.0     # s
    request_timeout_s: float = 600.0    # s, whole request
    max_connections: int = 4096

    @property
    def v1_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


class HttpSUT(SUT):
    name = "http"

    def __init__(self, config: HttpConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        self._client: httpx.AsyncClient | None = None     # model discovery; streaming over https
        self._raw: RawHttpClient | None = None             # streaming over plain http (low CPU per request)
        self._path = urlsplit(config.v1_url).path
        self._model = config.model

    async def start(self) -> None:
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        self._client = httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout)
        if cfg.base_url.startswith("http://"):
            self._raw = RawHttpClient(cfg.base_url, headers, cfg.connect_timeout_s)
        if self._model is None:
            self._model = await self._discover_model()

    async def _discover_model(self) -> str:
        url = self.config.v1_url + "/models"
        try:
            resp = await self._client.get(url)
            resp.raise_for_status()
            return resp.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ConnectionError(f"cannot list models at {url} ({type(e).__name__}: {e}); "
                                  f"is the server up? pass --served-model-name to skip this") from None

    def body(self, sample: Sample) -> dict:
        body = {"model": self._model, "prompt": list(sample.prompt) if isinstance(sample.prompt, tuple)
                else sample.prompt, "max_tokens": sample.max_output_tokens, "temperature": self.config.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if sample.ignore_eos:
            body["ignore_eos"] = True
        if sample.min_output_tokens > 0:
            body["min_tokens"] = sample.min_output_tokens
        return body

    async def process(self, sample: Sample, record: RequestRecord, clock: Clock,
                      on_first_token: FirstTokenHook = None) -> None:
        try:
            await asyncio.wait_for(self._stream(sample, record, clock, on_first_token), self.config.request_timeout_s)
        except HttpStatusError as e:
            record.error = str(e)
        except StreamDropped as e:
            record.error = f"stream dropped after {len(record.chunk_times_s)} chunks ({e})"
        except asyncio.TimeoutError:
            record.error = f"timed out (request timeout {self.config.request_timeout_s:g} s)"
        except OSError as e:     # ConnectionRefusedError, ConnectionError, ...
            record.error = f"connection failed: {type(e).__name__}: {e}"
        except (ValueError, KeyError, TypeError) as e:
            record.error = f"stream broken: {type(e).__name__}: {e}"
        if record.error is None and record.num_output_tokens is None:
            self._count_by_retokenizing(record)
        if record.error is None:
            record.error = unfinished_output(sample, record)

    async def _lines(self, body: dict) -> AsyncIterator[bytes]:
        """Response body lines from either transport; errors as HttpStatusError / StreamDropped / OSError."""
        if self._raw is not None:
            async for line in self._raw.post_lines(self._path + "/completions", json.dumps(body).encode()):
                yield line
            return
        try:
            async with self._client.stream("POST", self.config.v1_url + "/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise HttpStatusError(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    yield line.encode()
        except httpx.RemoteProtocolError as e:
            raise StreamDropped(str(e)) from None
        except httpx.ConnectError as e:
            raise ConnectionError(str(e)) from None

    async def _stream(self, sample: Sample, record: RequestRecord, clock: Clock, hook: FirstTokenHook) -> None:
        body = self.body(sample)
        record.sent_s = clock()
        done = False
        async for line in self._lines(body):
            if done or not line.startswith(b"data:"):
                continue                      # read to the end so the connection can be reused
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            had_first = record.first_token_s is not None
            self._on_event(json.loads(data), record, clock())
            if hook is not None and not had_first and record.first_token_s is not None:
                hook(record)
            if record.error:
                return
        if not done:
            raise StreamDropped("no [DONE]")

    def _on_event(self, event: dict, record: RequestRecord, now_s: float) -> None:
        if "error" in event:
            record.error = f"server error: {event['error']}"
            return
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            record.num_output_tokens = int(usage["completion_tokens"])
            record.num_prompt_tokens = usage.get("prompt_tokens")
        for choice in event.get("choices") or []:
            text = choice.get("text") or ""
            if text:
                if record.first_token_s is None:
                    record.first_token_s = now_s
                record.chunk_times_s.append(now_s)
                record.chunk_texts.append(text)
                record.text += text
                record.completed_s = now_s
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
                record.completed_s = now_s
                if record.first_token_s is None:      # tokens that decode to no text
                    record.first_token_s = now_s

    def _count_by_retokenizing(self, record: RequestRecord) -> None:
        if self.tokenizer is None:
            record.error = "server sent no usage and no tokenizer was given to count tokens (--tokenizer)"
            return
        record.num_output_tokens = len(self.tokenizer.encode(record.text, add_special_tokens=False))

    def finalize(self, records: list[RequestRecord]) -> None:
        """Tokens per streamed chunk, where they can be known: one per chunk when chunks == tokens,
        else incremental re-tokenization when it sums to the token count."""
        for r in records:
            if not r.ok or not r.chunk_times_s:
                continue
            if len(r.chunk_times_s) == r.num_output_tokens:
                r.chunk_num_tokens = [1] * len(r.chunk_times_s)
            elif self.tokenizer is not None:
                counts, prev, text = [], 0, ""
                for piece in r.chunk_texts:
                    text += piece
                    n = len(self.tokenizer.encode(text, add_special_tokens=False))
                    counts.append(n - prev)
                    prev = n
                if prev == r.num_output_tokens and all(c >= 0 for c in counts):
                    r.chunk_num_tokens = counts

    async def close(self) -> None:
        if self._raw is not None:
            await self._raw.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def describe(self) -> dict:
        return {"name": self.name, "url": self.config.base_url, "model": self._model}
