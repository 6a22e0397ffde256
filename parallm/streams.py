"""A request's stream of outputs, and the errors a pipeline client raises.

The pipeline connection (parallm/pipeline.py) opens each stream and feeds it (`deliver`, `fail`); its
reader (a client, or ingress) iterates it. The stream ends when every sample has a finish_reason, or
with ClientError when the request failed, timed out or its stage died. It owns its own end and tells
its owner through the two callbacks it was given (`forget`: deliver nothing more to this stream;
`abort`: stop the request in the engine), so it knows nothing of the pipeline.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from . import protocol


class ClientError(RuntimeError):
    """The server refused or failed a request (`status` follows HTTP; `retryable`: the same request
    may succeed later)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "", param: str | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.retryable = status, code, param, retryable


class StageFailure(ClientError):
    """A stage died (or did not answer) while the request was in flight; the same request may be retried."""


def error_of(message: protocol.RequestError) -> ClientError:
    cls = StageFailure if message.retryable and message.status >= 500 else ClientError
    return cls(message.message, status=message.status, code=message.code, param=message.param,
               retryable=message.retryable)


class RequestStream:
    """The outputs of one request as they arrive (`async for`, or `batch()` for everything that has
    arrived), ending once every one of its `n` samples has a finish_reason; an error ends it by raising
    ClientError. `close()` before the end aborts the request in the engine."""

    def __init__(self, rid: str, n: int, via_tokenizer: bool, timeout: float | None, *,
                 loop: asyncio.AbstractEventLoop, forget: Callable[["RequestStream"], None],
                 abort: Callable[[list[str]], object]) -> None:
        self.rid = rid
        self.via_tokenizer = via_tokenizer
        self.heard = False          # something came back: the engine has the request
        self.ended = False          # the pipeline delivers nothing more (finished, failed, timed out)
        self.closed = False         # the reader is done with it
        self._remaining = n         # samples the reader has not seen finish yet
        self._unfinished = n        # samples the pipeline has not delivered a finish for yet
        self._loop = loop
        self._forget = forget
        self._abort = abort
        self._items: deque[protocol.Output | protocol.RequestError] = deque()
        self._waiter: asyncio.Future | None = None
        self._timeout = timeout
        self._last = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ fed by the pipeline
    def deliver(self, item: protocol.Output | protocol.RequestError) -> None:
        """An output (or the request's error) for the reader; the last sample's finish ends the stream."""
        self.heard = True
        self._items.append(item)
        if self._timeout:
            self._last = time.monotonic()
        if type(item) is protocol.Output:
            if item.finish_reason is not None:
                self._unfinished -= 1
                if not self._unfinished:
                    self.end()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: protocol.RequestError) -> None:
        """End the stream with `error` (the reader raises it after what arrived before)."""
        self.end()
        self.deliver(error)

    def end(self) -> None:
        """Nothing more will be delivered: the owner forgets the rid and the idle timer stops."""
        self._forget(self)
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def start_timer(self) -> None:
        """Start the idle timeout (once the request was sent)."""
        if self._timeout and not self.ended:
            self._timer = self._loop.call_later(self._timeout, self._check_idle)

    def _check_idle(self) -> None:
        if self.ended:
            return
        idle = time.monotonic() - self._last
        if idle < self._timeout:
            self._timer = self._loop.call_later(self._timeout - idle, self._check_idle)
            return
        self.end()
        self._abort([self.rid])
        self.deliver(protocol.RequestError(rid=self.rid, status=504, code="timeout", retryable=True,
                                        message=f"request {self.rid}: nothing arrived for {self._timeout:g} s"))

    # ------------------------------------------------------------------ read by the consumer
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> protocol.Output:
        while not self._items:
            if not self._remaining:
                raise StopAsyncIteration
            await self._wait()
        return self._take()

    async def batch(self) -> list[protocol.Output]:
        """Every output that has arrived, in order, waiting for at least one; [] once the request is
        complete. An error raises after the outputs that came before it were returned."""
        out: list[protocol.Output] = []
        while True:
            while self._items:
                if out and type(self._items[0]) is protocol.RequestError:
                    return out
                out.append(self._take())
            if out or not self._remaining:
                return out
            await self._wait()

    def _take(self) -> protocol.Output:
        item = self._items.popleft()
        if type(item) is protocol.RequestError:
            self._remaining = 0
            raise error_of(item)
        if item.finish_reason is not None:
            self._remaining -= 1
        return item

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        """Done reading: a request that is still running is aborted in the engine."""
        if self.closed:
            return
        self.closed = True
        self._items.clear()
        if not self.ended:
            self.end()
            self._abort([self.rid])

    async def aclose(self) -> None:
        self.close()
