"""One stream of `(prompt index, Output)` from the backend iterators of a request's prompts.

A batched completion sends one TextSubmit per prompt; their outputs interleave in arrival order.
Whatever ends the stream (completion, an error, a timeout, the consumer closing it because the
client left) closes every backend iterator, which aborts what is still running.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from parallm.api.backend import Backend, BackendError
from parallm.api.errors import APIError
from parallm.protocol import Output, TextSubmit


def timed_out(first_token: bool) -> APIError:
    what = "the first token" if first_token else "the whole request"
    return APIError(504, f"The server took too long to generate {what}.", code="timeout")


class Deadlines:
    """Seconds left before 504: to the first output (`first_token_s`) and for everything (`total_s`)."""

    def __init__(self, first_token_s: float = 0.0, total_s: float = 0.0) -> None:
        now = asyncio.get_running_loop().time()
        self.first = now + first_token_s if first_token_s > 0 else None
        self.total = now + total_s if total_s > 0 else None
        self.started = False

    def left(self) -> float | None:
        ends = [t for t in (None if self.started else self.first, self.total) if t is not None]
        if not ends:
            return None
        return max(0.0, min(ends) - asyncio.get_running_loop().time())


async def _aclose(it: AsyncIterator[Output]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


async def _next(it: AsyncIterator[Output]) -> Output:
    return await it.__anext__()


async def merged(backend: Backend, submits: list[TextSubmit],
                 deadlines: Deadlines | None = None) -> AsyncIterator[tuple[int, Output]]:
    """Outputs of every submit, tagged with its index; raises BackendError (its `prompt` the submit's index)
    or a 504 APIError."""
    deadlines = deadlines or Deadlines()
    iterators = [backend.generate(s) for s in submits]
    pending: dict[asyncio.Future[Output], int] = {}
    try:
        if len(iterators) == 1:
            it = iterators[0]
            while True:
                left = deadlines.left()
                try:
                    out = await (it.__anext__() if left is None else asyncio.wait_for(it.__anext__(), left))
                except StopAsyncIteration:
                    return
                except BackendError as exc:
                    exc.prompt = 0
                    raise
                except asyncio.TimeoutError:
                    raise timed_out(not deadlines.started) from None
                deadlines.started = True
                yield 0, out
        for i, it in enumerate(iterators):
            pending[asyncio.ensure_future(_next(it))] = i
        while pending:
            done, _ = await asyncio.wait(pending, timeout=deadlines.left(), return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise timed_out(not deadlines.started)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                except BackendError as exc:
                    exc.prompt = i
                    raise
                pending[asyncio.ensure_future(_next(iterators[i]))] = i
                deadlines.started = True
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await _aclose(it)
