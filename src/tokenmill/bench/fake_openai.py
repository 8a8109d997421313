"""A minimal OpenAI-compatible streaming `/v1/completions` endpoint, for tests and harness benchmarks.

Raw asyncio HTTP/1.1 (keep-alive, chunked SSE) on 127.0.0.1, run in its own thread so the client's
event loop is not shared. Behaviour is set by `FakeServerConfig`: delays, tokens per chunk, whether
usage is sent, and injected faults (HTTP 500s, streams dropped mid-way). It generates no real text:
each token is the word "tok ".
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class FakeServerConfig:
    ttft_s: float = 0.0               # s before the first chunk
    token_delay_s: float = 0.0        # s between chunks
    tokens_per_chunk: int = 1         # > 1 mimics speculative decoding
    natural_len: int = 8              # tokens generated when ignore_eos is not set (EOS after these)
    send_usage: bool = True           # honour stream_options.include_usage
    fail_every_n: int = 0             # every n-th request gets HTTP 500 (0: never)
    drop_every_n: int = 0             # every n-th request's stream is cut after its first chunk (0: never)
    model: str = "fake-model"


class FakeOpenAIServer:
    def __init__(self, config: FakeServerConfig = FakeServerConfig()):
        self.config = config
        self.bodies: list[dict] = []      # every /v1/completions body received
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._count = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeOpenAIServer":
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True, name="fake-openai")
        self._thread.start()
        if not ready.wait(10.0):
            raise RuntimeError("fake OpenAI server did not start within 10 s")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5.0)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main(ready))
        finally:
            self._loop.close()

    async def _main(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=4096)
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        await self._stop.wait()
        server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self._route(method, path, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes, writer) -> bool:
        """Answer one request; False closes the connection."""
        if method == "GET" and path.endswith("/v1/models"):
            payload = json.dumps({"object": "list", "data": [{"id": self.config.model, "object": "model"}]})
            writer.write(_response(200, "application/json", payload.encode()))
            await writer.drain()
            return True
        if method == "POST" and path.endswith("/v1/completions"):
            return await self._completions(json.loads(body), writer)
        writer.write(_response(404, "application/json", b'{"error": "not found"}'))
        await writer.drain()
        return True

    async def _completions(self, req: dict, writer) -> bool:
        cfg = self.config
        self.bodies.append(req)
        self._count += 1
        n = self._count
        if cfg.fail_every_n and n % cfg.fail_every_n == 0:
            writer.write(_response(500, "application/json", b'{"error": "injected failure"}'))
            await writer.drain()
            return True
        max_tokens = int(req.get("max_tokens") or 16)
        num_tokens = max_tokens if req.get("ignore_eos") else min(max_tokens, max(cfg.natural_len,
                                                                                  req.get("min_tokens", 0)))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(cfg.ttft_s)
        sent = 0
        while sent < num_tokens:
            k = min(cfg.tokens_per_chunk, num_tokens - sent)
            sent += k
            finish = ("length" if max_tokens == num_tokens else "stop") if sent == num_tokens else None
            event = {"id": f"cmpl-{n}", "object": "text_completion", "created": int(time.time()),
                     "model": cfg.model, "choices": [{"index": 0, "text": "tok " * k, "finish_reason": finish}]}
            writer.write(_chunk(f"data: {json.dumps(event)}\n\n".encode()))
            await writer.drain()
            if cfg.drop_every_n and n % cfg.drop_every_n == 0:
                return False              # cut the stream: no terminating chunk, no [DONE]
            if sent < num_tokens:
                await asyncio.sleep(cfg.token_delay_s)
        if cfg.send_usage and (req.get("stream_options") or {}).get("include_usage"):
            prompt = req.get("prompt")
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else len(str(prompt).split()),
                     "completion_tokens": num_tokens, "total_tokens": 0}
            event = {"id": f"cmpl-{n}", "object": "text_completion", "model": cfg.model, "choices": [],
                     "usage": usage}
            writer.write(_chunk(f"data: {json.dumps(event)}\n\n".encode()))
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _response(status: int, ctype: str, payload: bytes) -> bytes:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(payload)}\r\n\r\n"
            .encode() + payload)
