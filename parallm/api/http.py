"""HTTP plumbing for the handlers: bounded body reads, msgspec JSON responses, client-disconnect
detection, and the server-sent-events response that aborts generation when the client leaves.

Starlette's StreamingResponse only notices a client that went away when a write fails, so a
request still in prefill would run to its end; `DisconnectWatch` listens for `http.disconnect`
for the whole life of a request instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from parallm.api.errors import APIError

log = logging.getLogger("parallm.api")

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
CLIENT_GONE = "parallm.client_gone"  # ASGI scope key: the client left before the answer was complete
REQUEST_ID = "parallm.request_id"    # ASGI scope key: the id a generation route gave the request (access log)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(body), status_code=status, headers=headers, media_type="application/json")


def encode(body: Any) -> bytes:
    return _encoder.encode(body)


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the {limit} bytes this server accepts.",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed `limit` bytes (0: no limit)."""
    if limit:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit and size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was complete."""


class DisconnectWatch:
    """Listens for `http.disconnect` on an ASGI receive channel (after the body was read)."""

    def __init__(self, receive: Receive) -> None:
        self.gone = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    async def race(self, work: Awaitable[T]) -> T:
        """Await `work`, cancelling it and raising ClientGone if the client leaves first."""
        task = asyncio.ensure_future(work)
        if self.gone.is_set():
            task.cancel()
        else:
            waiter = asyncio.ensure_future(self.gone.wait())
            try:
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                waiter.cancel()
            if task.done():
                return task.result()
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()

    def stop(self) -> None:
        self._task.cancel()


class EventStream(Response):
    """`text/event-stream` from an async iterator of ready-made events, closed (and so the
    generation aborted) as soon as the client disconnects or a write fails."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], watch: DisconnectWatch) -> None:
        self.events = events
        self.watch = watch
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.watch.race(self._pump(send))
        except (ClientGone, OSError):
            log.debug("client disconnected mid-stream")
            scope[CLIENT_GONE] = True  # counted as 499, not as the 200 already sent (api/metrics.py)
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            self.watch.stop()
