"""A minimal HTTP/1.1 keep-alive client on asyncio streams, for streaming POSTs to plain-http servers.

It exists for speed: the load generator must not be the bottleneck, and a general-purpose client
spends several ms of CPU per streamed request. It handles exactly what an OpenAI-compatible
streaming endpoint sends: a status line, headers, then a chunked, Content-Length or close-delimited
body, read as lines.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import urlsplit


class HttpStatusError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}")
        self.status = status


class StreamDropped(Exception):
    """The connection ended before the response body was complete."""


class RawHttpClient:
    def __init__(self, base_url: str, headers: dict[str, str], connect_timeout_s: float):
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"raw client supports http:// only, got {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.connect_timeout_s = connect_timeout_s
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"Host: {self.host}:{self.port}\r\nContent-Type: application/json\r\n{extra}"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self):
        try:
            return await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectionError(f"connect to {self.host}:{self.port} timed out") from None

    async def post_lines(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST and yield the response body line by line; raises HttpStatusError, StreamDropped, OSError.
        Read the body to its end: a connection goes back to the pool only after a complete body."""
        request = (f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n").encode() + body
        reused = bool(self._idle)
        reader, writer = self._idle.pop() if reused else await self._connect()
        try:
            writer.write(request)
            status_line = await reader.readline()
        except ConnectionError:                 # reset: on a pooled connection, the server dropped it idle
            if not reused:
                raise
            status_line = b""
        if not status_line and reused:
            # The server closed (EOF) or reset (RST, racing its keep-alive timeout) the idle connection before
            # reading the request, so it never ran: retry once, on a fresh connection.
            writer.close()
            reader, writer = await self._connect()
            writer.write(request)
            status_line = await reader.readline()
        if not status_line:
            writer.close()
            raise StreamDropped("connection closed before a response")
        keep = False                               # reuse only after a fully read, delimited body
        try:
            status = int(status_line.split(b" ", 2)[1])
            headers = await _read_headers(reader)
            delimited = "content-length" in headers or headers.get("transfer-encoding", "").lower() == "chunked"
            body_iter = _body(reader, headers)
            if status != 200:
                raise HttpStatusError(status, b"".join([line async for line in body_iter]))
            async for line in body_iter:
                yield line
            keep = delimited and headers.get("connection", "keep-alive").lower() != "close"
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            keep = False
            raise StreamDropped(f"{type(e).__name__}: {e}") from None
        finally:
            if keep:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers = {}
    while True:
        line = await reader.readline()
        if not line:
            raise asyncio.IncompleteReadError(b"", None)
        if line in (b"\r\n", b"\n"):
            return headers
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """Body lines (without line endings) for chunked, Content-Length and close-delimited bodies."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        pending = b""
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"x", 16)
            if size == 0:
                await reader.readline()           # the CRLF after the last chunk (no trailers)
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")
        if pending:
            yield pending
    elif "content-length" in headers:
        data = await reader.readexactly(int(headers["content-length"]))
        for line in data.split(b"\n"):
            yield line.rstrip(b"\r")
    else:
        while line := await reader.readline():
            yield line.rstrip(b"\r\n")
