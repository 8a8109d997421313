"""Server-Sent Events and client-disconnect handling.

Streaming: Starlette cancels the body iterator when the client goes away; `SSEResponse` then runs the
`EngineCall`'s close (shielded from that cancellation), which aborts the engine requests.
Non-streaming: `until_disconnect` races the handler against the client's `http.disconnect`, so a client
that gives up on a long completion also frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tokenmill.server.errors import OpenAIError

logger = logging.getLogger("tokenmill.server")

DONE = b"data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> bytes:
    if isinstance(payload, BaseModel):
        return b"data: " + payload.model_dump_json().encode() + b"\n\n"
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response whose `on_close` runs however the stream ends."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(_guard(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


async def _guard(content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Errors after the headers went out become an SSE error event, then [DONE]."""
    try:
        async for chunk in content:
            yield chunk
    except OpenAIError as e:
        yield sse(e.body())
        yield DONE
    except Exception as e:  # noqa: BLE001 - the status line is sent; report it in the stream
        logger.exception("error while streaming")
        yield sse(OpenAIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error").body())
        yield DONE


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`; if the client disconnects first, cancel it (its finally blocks abort the engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody is listening any more
        pass
    return Response(status_code=499)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def respond(writer, close: Callable[[], Awaitable[None]], stream: bool) -> Response:
    """The response for one engine call: SSE that runs `close` when the stream ends (however it ends), or
    the full body, with `close` run on every exit path."""
    if stream:
        return SSEResponse(writer.stream(), close)
    try:
        return await writer.full()
    finally:
        await close()
