"""A minimal HTTP/1.1 client over raw asyncio sockets, for tests that must behave as careless clients do:
send broken bytes, trickle a body, or hang up at a chosen moment. One request per connection."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

# Where a client may hang up, in the order a request goes through them.
HANGUP_STAGES = ("headers-partial", "body-partial", "request-sent", "status-line", "first-event", "mid-stream")


@dataclass
class RawResponse:
    status: int | None = None          # None: no status line came back (we hung up first)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self):
        return json.loads(self.body)

    @property
    def events(self) -> list[str]:
        """The `data:` payloads of an SSE body."""
        return [line[6:] for line in self.body.decode("utf-8", "replace").splitlines() if line.startswith("data: ")]


def build_request(method: str, path: str, body: bytes | None,
                  headers: dict[str, str] | None = None) -> tuple[bytes, bytes]:
    """(head, body) bytes of one request; Content-Length set unless given, Connection: close."""
    head = {"Host": "127.0.0.1", "Connection": "close"}
    if body is not None:
        head["Content-Type"] = "application/json"
        head["Content-Length"] = str(len(body))
    head.update(headers or {})
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), body or b""


async def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                  hangup: str | None = None, trickle_s: float = 0.0, read_delay_s: float = 0.0,
                  timeout_s: float = 60.0) -> RawResponse:
    """Send one request and read the whole response, or hang up at stage `hangup` (see HANGUP_STAGES).
    trickle_s: pause between body pieces (a slow sender); read_delay_s: pause between reads (a slow reader)."""
    head, payload = build_request(method, path, body, headers)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(_exchange(reader, writer, head, payload, hangup, trickle_s, read_delay_s),
                                      timeout_s)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def _exchange(reader, writer, head, payload, hangup, trickle_s, read_delay_s) -> RawResponse:
    if hangup == "headers-partial":
        writer.write(head[: len(head) // 2])
        await writer.drain()
        return RawResponse()
    writer.write(head)
    if hangup == "body-partial":
        writer.write(payload[: len(payload) // 2])
        await writer.drain()
        return RawResponse()
    await _send_body(writer, payload, trickle_s)
    if hangup == "request-sent":
        return RawResponse()
    while True:
        status_line = await reader.readline()
        response = RawResponse(status=int(status_line.split()[1]) if status_line else None)
        if hangup == "status-line" or response.status is None:
            return response
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            response.headers[key.strip().lower()] = value.strip()
        if not 100 <= response.status < 200:     # an interim response (100 Continue): the real one follows
            break
    response.body = await _read_body(reader, response, hangup, read_delay_s)
    return response


async def _send_body(writer, payload: bytes, trickle_s: float) -> None:
    if trickle_s <= 0:
        writer.write(payload)
    else:
        step = max(1, len(payload) // 8)
        for i in range(0, len(payload), step):
            writer.write(payload[i:i + step])
            await writer.drain()
            await asyncio.sleep(trickle_s)
    await writer.drain()


async def _read_body(reader, response: RawResponse, hangup: str | None, read_delay_s: float) -> bytes:
    """The body (chunked or not); for SSE, stops after the first or a few events when told to hang up."""
    events_wanted = {"first-event": 1, "mid-stream": 3}.get(hangup)
    body = b""
    while True:
        if read_delay_s:
            await asyncio.sleep(read_delay_s)
        piece = await _read_piece(reader, response.headers)
        if not piece:
            return body
        body += piece
        if events_wanted is not None and body.count(b"\n\n") >= events_wanted:
            return body


async def _read_piece(reader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding") == "chunked":
        size_line = await reader.readline()
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            return b""
        data = await reader.readexactly(size)
        await reader.readline()
        return data
    return await reader.read(65536)
