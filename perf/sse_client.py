"""A lean HTTP/1.1 client for the benchmarks' streaming requests: POST a JSON body, read the server-sent
events back, keep the connection for the next request.

Why not httpx: a client process spends its CPU on every event it reads, and on one host the benchmark's
clients and the server share the cores. httpx (its connection pool, h11's parser, the line decoder
behind `aiter_lines`) costs ~180 µs of CPU per event on a 2-core x86 host, so at c=256 on a GPU the
benchmark needed 8-16 client processes that kept 2-3 cores busy beside the server they measured
(docs/performance.md, issue 37). This client reads a response the way the OpenAI streams are framed
(a status line and headers, then a chunked or sized body of `data: ...` lines) with asyncio's stream
reader and nothing else; `python -m perf.bench_sse_client` compares the two per event.

Only what the benchmarks need: http:// URLs, one request at a time per connection, `data:` lines
(the OpenAI streams put one JSON document on each; multi-line events are not joined).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

READ_LIMIT = 1 << 20  # the longest status line, header block or chunk-size line the reader accepts


class HTTPStatusError(Exception):
    """A response other than 200: its status and (up to 1 KiB of) its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:1024].decode(errors='replace')}")
        self.status = status
        self.body = body


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class SSEClient:
    """Keep-alive connections to one server (`url`: http://host[:port][/prefix]); at most as many open at
    once as requests in flight."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the lean client takes http://host[:port] URLs, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.netloc = parts.netloc.encode()
        self.prefix = parts.path.rstrip("/")
        self._idle: list[_Connection] = []

    async def __aenter__(self) -> SSEClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _connection(self) -> _Connection:
        if self._idle:
            return self._idle.pop()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=READ_LIMIT)
        return _Connection(reader, writer)

    async def post_events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) to `path` and yield the payload of each `data:` line as it arrives; raises
        HTTPStatusError on a status other than 200. The connection goes back to the pool only if the
        response was read to its end and the server did not ask to close it."""
        conn = await self._connection()
        reusable = False
        try:
            conn.writer.write(b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                              b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                              % (self.prefix.encode(), path.encode(), self.netloc, len(body), body))
            status, chunked, length, keep = await _read_head(conn.reader)
            if status != 200:
                error = b"".join([piece async for piece in _body(conn.reader, chunked, length)])
                reusable = keep and (chunked or length is not None)
                raise HTTPStatusError(status, error)
            pending = b""
            async for piece in _body(conn.reader, chunked, length):
                lines = (pending + piece).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if line[:5] == b"data:":
                        yield line[5:].strip()
            if pending[:5] == b"data:":
                yield pending[5:].strip()
            reusable = keep and (chunked or length is not None)
        finally:
            if reusable:
                self._idle.append(conn)
            else:
                conn.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, bool, int | None, bool]:
    """(status, chunked, Content-Length or None, keep-alive) of a response's head."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    fields = lines[0].split(b" ", 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/1."):
        raise ConnectionError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(fields[1])
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    chunked = b"chunked" in headers.get(b"transfer-encoding", b"")
    length = None if chunked or b"content-length" not in headers else int(headers[b"content-length"])
    keep = headers.get(b"connection", b"") != b"close" and fields[0] != b"HTTP/1.0"
    return status, chunked, length, keep


async def _body(reader: asyncio.StreamReader, chunked: bool, length: int | None) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive: chunks of a chunked body, a sized body whole, else up to EOF."""
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, then the blank line
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif length is not None:
        if length:
            yield await reader.readexactly(length)
    else:
        while data := await reader.read(65536):
            yield data
