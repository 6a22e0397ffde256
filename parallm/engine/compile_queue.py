"""Requests whose grammar constraint is compiling, off the engine's step loop.

Compiling a grammar against the tokenizer can take seconds (60k choices: 3.7 s on a CPU). Done inside
`Engine.add_request`, on the stage's loop, it held every other request's next token that long. The
engine stage parks such a request here instead: its grammar compiles on the constraints' compile thread
(Constraints.compile_later) while the loop keeps stepping; once it is compiled (or has failed: the
failure is cached too) the stage submits the request again and `add_request` finds it at once. A grammar
that has not compiled by its deadline (engine.constraint_timeout_s) gets its request refused.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

from parallm.protocol import Constraint
from parallm.text.grammar import GrammarError, check_size

from .constraints import Constraints

T = TypeVar("T")


class CompileQueue(Generic[T]):
    def __init__(self, constraints: Constraints, timeout_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic, on_done: Callable[[Future], None] = lambda _: None) -> None:
        self.constraints = constraints
        self.on_done = on_done  # on the compiling thread, as each grammar is done (the engine stage's Waker.wake)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._waiting: dict[str, tuple[Future, float, T]] = {}
        self.timed_out = 0

    def needs(self, c: Constraint | None) -> bool:
        """Whether a request with constraint `c` must wait for a compile (not when its grammar is cached, or
        is too large: add_request refuses that one at once)."""
        if c is None:
            return False
        try:
            check_size(c, self.max_bytes)
        except GrammarError:
            return False
        return not self.constraints.cached(c)

    def add(self, rid: str, request: T, c: Constraint) -> None:
        deadline = self.clock() + self.timeout_s
        future = self.constraints.compile_later(c, deadline)
        self._waiting[rid] = (future, deadline, request)
        future.add_done_callback(self.on_done)

    def take(self) -> tuple[list[T], list[T]]:
        """(requests whose grammar is compiled or failed: submit them again, requests past their deadline:
        refuse them), both in arrival order."""
        ready: list[T] = []
        expired: list[T] = []
        now = self.clock()
        for rid, (future, deadline, request) in list(self._waiting.items()):
            if future.done() and not isinstance(future.exception(), TimeoutError):
                ready.append(request)
            elif now > deadline or future.done():
                expired.append(request)
                self.timed_out += 1
            else:
                continue
            del self._waiting[rid]
        return ready, expired

    def pop(self, rid: str) -> T | None:
        entry = self._waiting.pop(rid, None)
        return None if entry is None else entry[2]

    def rids(self) -> list[str]:
        return list(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)
