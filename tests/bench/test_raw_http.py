"""The load generator's own HTTP/1.1 client (bench/sut/raw_http.py) against a raw socket server."""
import asyncio
import socket
import struct

import pytest

from tokenmill.bench.sut.raw_http import RawHttpClient, StreamDropped

RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"8\r\ndata: 1\n\r\n0\r\n\r\n")


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a server's keep-alive timeout can race a client's reuse."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _serve_then_drop(close_with_reset: bool, connections: list):
    """Answers one request per connection, then drops that connection while idle (after the client's
    next request has arrived, unread, so the client is already waiting on it)."""
    async def handle(reader, writer):
        connections.append(writer)
        await _read_request(reader)
        writer.write(RESPONSE)
        await writer.drain()
        await reader.read(1)                  # the client's next request begins: drop the connection
        if close_with_reset:
            _reset(writer)
        else:
            writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("close_with_reset", [True, False])
def test_a_pooled_connection_the_server_dropped_is_retried_once_on_a_fresh_one(close_with_reset):
    async def main():
        connections = []
        server = await _serve_then_drop(close_with_reset, connections)
        port = server.sockets[0].getsockname()[1]
        client = RawHttpClient(f"http://127.0.0.1:{port}", {}, 5.0)
        try:
            first = [line async for line in client.post_lines("/v1/completions", b"{}")]
            second = [line async for line in client.post_lines("/v1/completions", b"{}")]
        finally:
            await client.close()
            server.close()
        return first, second, len(connections)
    first, second, n = asyncio.run(main())
    assert first == second == [b"data: 1"] and n == 2


def test_a_fresh_connection_reset_before_a_response_is_an_error_not_a_retry():
    async def main():
        async def handle(reader, writer):
            await _read_request(reader)
            _reset(writer)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = RawHttpClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", {}, 5.0)
        try:
            with pytest.raises((ConnectionError, StreamDropped)):
                async for _ in client.post_lines("/v1/completions", b"{}"):
                    pass
        finally:
            server.close()
    asyncio.run(main())
