"""Client disconnects over a real socket: uvicorn's http.disconnect semantics differ from TestClient's."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn

from parallm.api.app import build_app
from parallm.config import ServerConfig
from test_api_fakes import FakeBackend


@pytest.mark.parametrize("stream, hang_after", [(True, 1), (True, 0), (False, 0)])
def test_dropped_connection_aborts_generation(stream, hang_after):
    async def run():
        backend = FakeBackend(hang_after=hang_after)
        app = build_app(backend, ServerConfig())
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            async with httpx.AsyncClient() as client:
                async def request():
                    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                             json={"prompt": "x", "stream": stream}) as response:
                        async for _ in response.aiter_lines():
                            pass

                pending = asyncio.create_task(request())
                await asyncio.wait_for(backend.hanging.wait(), 5)
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            for _ in range(200):
                if backend.iterators[0].closed:
                    break
                await asyncio.sleep(0.01)
            return backend.iterators[0].closed, app.state.generator.gate.in_flight
        finally:
            server.should_exit = True
            await serving

    assert asyncio.run(run()) == (True, 0)
