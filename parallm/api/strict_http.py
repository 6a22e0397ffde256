"""uvicorn's h11 protocol with read deadlines, so that a slow client cannot hold a connection open.

uvicorn closes a connection idle between requests (`timeout_keep_alive`) but has no limit on how
long a request's headers or body may take to arrive: a slowloris client that sends one header line
every few seconds keeps its connection (and a file descriptor) forever. Here a request's headers
must be complete within `header_timeout_s` of the connection opening or of their first byte after
a keep-alive wait, and its body within `body_timeout_s` of its headers; past that the connection
gets a 408 and is closed.
"""

from __future__ import annotations

import asyncio
import logging

from typing import Any

import h11
from h11._writers import ChunkedWriter
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

log = logging.getLogger("parallm.api")

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: 16\r\nconnection: close\r\n\r\nRequest Timeout\n")


class StrictH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0
    body_timeout_s: float = 120.0
    closed_slow = 0  # connections closed for a late header or body, in this process

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._waiting_for: str = ""
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and "send" not in cycle.__dict__:  # its ASGI task reads cycle.send when it starts
            cycle.send = lambda message: _send(cycle, message)  # type: ignore[method-assign]
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle until the next request: uvicorn's keep-alive timeout
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _track(self) -> None:
        """Deadline for what the peer owes now: the rest of a request's headers, or its body."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.conn.trailing_data[0] and self._waiting_for != "headers":
                self._arm("headers")  # the first bytes of the next request's headers
        elif state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._arm("body")
        else:
            self._disarm()

    def _arm(self, what: str) -> None:
        self._disarm()
        self._waiting_for = what
        timeout = self.header_timeout_s if what == "headers" else self.body_timeout_s
        if timeout > 0:
            self._read_timer = self.loop.call_later(timeout, self._too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_read_timer", None) is not None:
            self._read_timer.cancel()
        self._read_timer = None
        self._waiting_for = ""

    def _too_slow(self) -> None:
        what = self._waiting_for
        self._read_timer = None
        if self.transport.is_closing():
            return
        StrictH11Protocol.closed_slow += 1
        prefix = "%s:%d - " % tuple(self.client[:2]) if self.client else ""
        log.info("%sclosed a connection whose request %s took longer than %g s", prefix, what,
                 self.header_timeout_s if what == "headers" else self.body_timeout_s)
        if self.cycle is None or not self.cycle.response_started or self.cycle.response_complete:
            self.transport.write(_TIMEOUT_408)
        self.transport.close()


async def _send(cycle: RequestResponseCycle, message: Any) -> None:
    """uvicorn's ASGI send, with a streamed response's body chunks written straight to the socket:
    what h11 writes for a Data event in a chunked body (its state does not change there), without
    its event objects and state checks, which were ~a quarter of ingress' CPU per SSE event."""
    if (message["type"] == "http.response.body" and message.get("more_body", False) and cycle.response_started
            and not cycle.response_complete and not cycle.disconnected and not cycle.flow.write_paused
            and type(getattr(cycle.conn, "_writer", None)) is ChunkedWriter and cycle.scope["method"] != "HEAD"):
        body = message.get("body", b"")
        if body:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return
    await RequestResponseCycle.send(cycle, message)


def strict_protocol(header_timeout_s: float, body_timeout_s: float) -> type[StrictH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...), with these deadlines (0 = none)."""
    return type("StrictH11", (StrictH11Protocol,), {"header_timeout_s": float(header_timeout_s),
                                                    "body_timeout_s": float(body_timeout_s)})
