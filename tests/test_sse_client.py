"""The benchmarks' lean HTTP client (perf/sse_client.py) against a scripted server: framing, keep-alive, errors."""

from __future__ import annotations

import asyncio

import pytest

from perf.sse_client import HTTPStatusError, SSEClient


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Scripted:
    """A server answering the n-th request (over any connection) with responses[n]; counts connections and
    keeps each request's path and body."""

    def __init__(self, responses: list[bytes]) -> None:
        self.responses, self.connections, self.requests = responses, 0, []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = next(int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                              if k.lower() == b"content-length")
                self.requests.append((lines[0].split(b" ")[1], await reader.readexactly(length)))
                response = self.responses[len(self.requests) - 1]
                for piece in response if isinstance(response, list) else [response]:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)  # separate reads on the client
                if b"connection: close" in (response[0] if isinstance(response, list) else response).lower():
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def _collect(client: SSEClient, path: str = "/v1/chat/completions", body: bytes = b"{}") -> list[bytes]:
    return [data async for data in client.post_events(path, body)]


def _run(responses: list, scenario) -> Scripted:
    server = Scripted(responses)

    async def main() -> None:
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with srv:
            async with SSEClient(f"http://127.0.0.1:{port}") as client:
                await scenario(client)

    asyncio.run(main())
    return server


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_events_split_across_chunks_and_several_in_one_are_read_whole():
    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: a comment\n\ndata: [DONE]\n\n'
    pieces = [HEAD + _chunk(stream[:5]), _chunk(stream[5:20]), _chunk(stream[20:]) + b"0\r\n\r\n"]
    seen = []

    async def scenario(client):
        seen.append(await _collect(client, body=b'{"x":1}'))

    server = _run([pieces], scenario)
    assert seen == [[b'{"a":1}', b'{"b":2}', b"[DONE]"]]
    assert server.requests == [(b"/v1/chat/completions", b'{"x":1}')]


def test_a_connection_is_kept_for_the_next_request_unless_the_server_closes_it():
    ok = HEAD + _chunk(b"data: 1\n\n") + b"0\r\n\r\n"
    closing = (b"HTTP/1.1 200 OK\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
               + _chunk(b"data: 2\n\n") + b"0\r\n\r\n")
    seen = []

    async def scenario(client):
        for _ in range(4):
            seen.append(await _collect(client))

    server = _run([ok, ok, closing, ok], scenario)
    assert seen == [[b"1"], [b"1"], [b"2"], [b"1"]]
    assert server.connections == 2  # the first three on one connection, the fourth after the server closed it


def test_a_status_other_than_200_raises_with_its_body_and_the_connection_stays_usable():
    error = b'{"error":{"message":"bad","type":"invalid_request_error"}}'
    refused = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(error), error)
    sized = b"data: 7\n\ndata: 8"  # a sized body; its last line has no newline
    answered = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(sized), sized)
    caught, seen = [], []

    async def scenario(client):
        with pytest.raises(HTTPStatusError) as info:
            await _collect(client)
        caught.append(info.value)
        seen.append(await _collect(client))

    server = _run([refused, answered], scenario)
    assert caught[0].status == 400 and caught[0].body == error
    assert seen == [[b"7", b"8"]]
    assert server.connections == 1


def test_only_http_urls_are_taken():
    with pytest.raises(ValueError, match="http://"):
        SSEClient("https://example.com")


def test_an_http_1_0_stream_without_a_length_is_read_to_its_end_and_not_kept():
    """mlx_lm.server's way (http.server: HTTP/1.0, no length, the connection closed at the end)."""
    streamed = [b"HTTP/1.0 200 OK\r\nContent-type: text/event-stream\r\n\r\ndata: {\"a\"", b":1}\n\ndata: [DONE]\n\n"]
    seen = []

    async def scenario(client):
        seen.append(await _collect(client))
        seen.append(await _collect(client))

    class Closing(Scripted):
        async def handle(self, reader, writer):
            self.connections += 1
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
                          if k.lower() == b"content-length")
            await reader.readexactly(length)
            for piece in streamed:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)
            writer.close()

    server = Closing([])

    async def main() -> None:
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        async with srv:
            async with SSEClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}") as client:
                await scenario(client)

    asyncio.run(main())
    assert seen == [[b'{"a":1}', b"[DONE]"]] * 2
    assert server.connections == 2
