"""Header and body read deadlines (parallm/api/strict_http.py) on a real uvicorn socket: 50 slowloris
connections are answered 408 and closed, a slow body too, while normal requests and keep-alive work."""

from __future__ import annotations

import asyncio
import time

import httpx
import uvicorn

from parallm.api.app import build_app
from parallm.api.strict_http import strict_protocol
from parallm.config import ServerConfig
from test_api_fakes import FakeBackend


async def _serve(header_s: float, body_s: float):
    app = build_app(FakeBackend(), ServerConfig())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           http=strict_protocol(header_s, body_s), timeout_keep_alive=30))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def _slow_client(port: int, first: bytes, drip: bytes, until: float) -> tuple[bytes, float]:
    """Send `first`, then one byte of `drip` every 0.2 s; what the server answered and when it closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(first)
    answer = b""
    try:
        for byte in drip:
            try:
                chunk = await asyncio.wait_for(reader.read(1024), 0.2)
            except asyncio.TimeoutError:
                writer.write(bytes([byte]))
                if time.monotonic() - start > until:
                    break
                continue
            answer += chunk
            if not chunk:
                break
        else:
            answer += await asyncio.wait_for(reader.read(1024), until)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    return answer, time.monotonic() - start


def test_fifty_slowloris_connections_are_closed_and_normal_requests_still_work():
    async def run():
        server, task, port = await _serve(header_s=1.0, body_s=1.0)
        try:
            slow_headers = [_slow_client(port, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-a: b\r\n" * 100, 8)
                            for _ in range(50)]
            slow_body = _slow_client(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                                           b"application/json\r\ncontent-length: 1000\r\n\r\n{", b" " * 1000, 8)
            silent = _slow_client(port, b"", b"", 8)  # connects and sends nothing
            gather = asyncio.gather(*slow_headers, slow_body, silent)
            async with httpx.AsyncClient() as client:
                for _ in range(3):  # keep-alive across requests is not cut by the header deadline
                    r = await client.get(f"http://127.0.0.1:{port}/health")
                    assert r.status_code == 200
                    await asyncio.sleep(0.6)
                return await gather
        finally:
            server.should_exit = True
            await task

    results = asyncio.run(run())
    for answer, took in results:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert took < 4.0, took


def test_a_request_sent_at_once_is_untouched_by_short_deadlines():
    async def run():
        server, task, port = await _serve(header_s=0.5, body_s=0.5)
        try:
            async with httpx.AsyncClient() as client:
                r = await client.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2})
                return r.status_code
        finally:
            server.should_exit = True
            await task

    assert asyncio.run(run()) == 200
