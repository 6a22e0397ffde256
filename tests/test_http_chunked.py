"""Streamed bodies through parallm's HTTP protocol (parallm/api/strict_http.py writes a chunked body's
pieces itself, past h11): on a real socket the bytes equal plain uvicorn h11's, keep-alive included."""

from __future__ import annotations

import asyncio
import re

import uvicorn

from parallm.api.app import build_app
from parallm.api.strict_http import strict_protocol
from parallm.config import ServerConfig
from test_api_fakes import FakeBackend

BODY = (b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": true, "n": 2, '
        b'"max_tokens": 5, "stream_options": {"include_usage": true}}')
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY))


async def _two_streams(http: object) -> bytes:
    """Two streamed requests on one keep-alive connection: everything the server sent."""
    app = build_app(FakeBackend(), ServerConfig())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", http=http))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = b""
    try:
        for _ in range(2):
            writer.write(REQUEST)
            while not answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                answer += await asyncio.wait_for(reader.read(1 << 16), 5)
            answer += b"|"
    finally:
        writer.close()
        server.should_exit = True
        await task
    return answer


def _comparable(raw: bytes) -> bytes:
    """Without what differs between two runs: dates, ids and timestamps."""
    raw = re.sub(rb"date: [^\r]*", b"date: -", raw)
    raw = re.sub(rb'"(id|created|system_fingerprint)":("[^"]*"|\d+)', rb'"\1":-', raw)
    return raw


def test_chunked_stream_bytes_equal_plain_h11():
    strict = asyncio.run(_two_streams(strict_protocol(10.0, 10.0)))
    plain = asyncio.run(_two_streams("h11"))
    assert strict.count(b"HTTP/1.1 200") == 2 and strict.count(b"data: [DONE]") == 2
    assert b"transfer-encoding: chunked" in strict.lower()
    assert _comparable(strict) == _comparable(plain)
