"""Admission by KV memory pressure (kv.pressure_threshold), pure Python.

Utilization is counted in tokens, as a paged store spends memory: the tokens live sequences hold
(running and prefilling: prompt and output so far) over the tokens the live KV can hold. Demand adds
the prompts of the sequences still waiting for a row. Past the threshold a new request is refused
with a retryable 503 (the client retries after `Retry-After`) instead of queueing behind work the
memory cannot hold: the queue it would join is what drives the scheduler to preempt and recompute,
over and over, when admitted work outgrows the KV (a preemption storm). A request that arrives to
an empty engine is always taken (whether it can ever fit is admission's 400, not pressure's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from .request import RequestRejected
from .sequence import Sequence

DEGRADED_SHARE = 0.9  # /health says degraded from this share of the threshold on
REFUSING_FOR_S = 2.0  # and overloaded for this long after a refusal (ingress polls stats every 0.5 s)


@dataclass(slots=True, frozen=True)
class KVLoad:
    live_tokens: int      # held by running and prefilling sequences
    waiting_tokens: int   # prompts (and tokens generated before a preemption) of waiting sequences
    capacity_tokens: int  # what the live KV can hold

    @property
    def utilization(self) -> float:
        return self.live_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    @property
    def demand(self) -> float:
        return (self.live_tokens + self.waiting_tokens) / self.capacity_tokens if self.capacity_tokens else 0.0


def kv_load(live: Iterable[Sequence], waiting: Iterable[Sequence], capacity_tokens: int) -> KVLoad:
    held = sum(s.num_tokens for s in live)
    queued = 0
    for s in waiting:
        followers = len(s.group.followers) if s.group is not None and s.group.leader is s else 0
        queued += s.num_tokens * (1 + followers)
    return KVLoad(held, queued, capacity_tokens)


def pressure_state(demand: float, threshold: float | None, refused_recently: bool = False) -> str:
    """"ok", "degraded" (from DEGRADED_SHARE of the threshold) or "overloaded" (past it, or a request
    was refused in the last REFUSING_FOR_S: new requests are being refused)."""
    if threshold is None:
        return "ok"
    if demand > threshold or refused_recently:
        return "overloaded"
    return "degraded" if demand >= DEGRADED_SHARE * threshold else "ok"


class PressureGate:
    """Refuses new work while the KV demand is past `threshold` (None: never)."""

    def __init__(self, threshold: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.clock = clock
        self.rejected = 0
        self._rejected_at = float("-inf")

    def state(self, load: KVLoad) -> str:
        """pressure_state of this load, as /health reports it."""
        return pressure_state(load.demand, self.threshold, self.clock() - self._rejected_at < REFUSING_FOR_S)

    def admit(self, load: KVLoad, new_tokens: int) -> None:
        """Raise a retryable 503 RequestRejected if taking `new_tokens` more would put the demand past
        the threshold (never when nothing is live or waiting)."""
        if self.threshold is None or not (load.live_tokens or load.waiting_tokens):
            return
        demand = (load.live_tokens + load.waiting_tokens + new_tokens) / max(1, load.capacity_tokens)
        if demand <= self.threshold:
            return
        self.rejected += 1
        self._rejected_at = self.clock()
        raise RequestRejected(
            f"the engine's KV memory is under pressure ({100 * load.demand:.0f}% of its {load.capacity_tokens} "
            f"token slots held or wanted, kv.pressure_threshold {100 * self.threshold:.0f}%); retry shortly",
            status=503, code="kv_pressure", retryable=True)
