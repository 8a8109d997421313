"""ASGI middleware that runs before any parsing: API key (401), then body size (413).

A response never starts while the client is still sending a body the server did not read (a 401, a
404 or 405 on a route that takes no body, ...): the rest is read and dropped first, within the body limit
and DRAIN_TIMEOUT_S. Closing the connection on unread bytes makes the kernel reset it, and the client
then sees a reset instead of the response.
"""
from __future__ import annotations

import asyncio
import hmac

from fastapi import HTTPException

from tokenmill.server.errors import OpenAIError

# Paths that need the API key when one is set; /health, /version and /metrics stay open for probes.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
DRAIN_TIMEOUT_S = 5.0   # longest wait for the unread rest of a body before responding anyway


class RequestGuard:
    """Checks the API key, then the declared body size; counts the bytes of bodies without a length."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(int(length)).response()(scope, receive, send)   # not worth reading
        body = _BodyTracker(self._limited(receive))
        send = body.drained_before(send)
        if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            if not self._authorized(headers.get("authorization", "")):
                err = OpenAIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                return await err.response()(scope, body.receive, send)
        await self.app(scope, body.receive, send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large(self, size: int | None) -> OpenAIError:
        got = f"{size} bytes" if size is not None else "more"
        return OpenAIError(413, f"request body is too large: {got}, limit {self.max_body_bytes} bytes",
                           code="request_too_large")

    def _limited(self, receive):
        received = 0

        async def wrapped():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large(None).message)
            return message
        return wrapped


class _BodyTracker:
    """Wraps `receive` to know whether the request body was read to its end; `drained_before(send)` reads
    and drops whatever is left before the response starts."""

    def __init__(self, receive) -> None:
        self._receive = receive
        self.done = False          # the last body message (or a disconnect) has been received

    async def receive(self):
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.done = True
        return message

    def drained_before(self, send):
        async def wrapped(message):
            if message["type"] == "http.response.start" and not self.done:
                await self._drain()
            await send(message)
        return wrapped

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                while not self.done:
                    await self.receive()
        except (TimeoutError, HTTPException):   # too slow, or over the body limit: respond anyway
            pass
