"""Request priority: who is served first, and the starvation rule (docs/scheduling.md).

A request's `priority` is an int, lower served first (vLLM's convention). Its *effective*
priority is `priority - floor(seconds since it arrived / aging_s)` when `aging_s > 0` (the
starvation rule: a waiting request gains one level per `engine.priority_aging_s` seconds, so a
flood of better-priority requests delays it by a bounded time, never forever), `priority` itself
when `aging_s` is 0 (strict priority). Sequences are ordered by (effective priority, arrival):
equal priorities keep first-come first-served order, and since the effective priority of equal
priorities only falls with age, aging never reorders them.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Iterator

from .sequence import Sequence


class PriorityPolicy:
    def __init__(self, aging_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.aging_s = aging_s
        self.clock = clock

    def effective(self, seq: Sequence, now: float) -> int:
        if self.aging_s <= 0:
            return seq.priority
        return seq.priority - int((now - seq.arrived_at) // self.aging_s)

    def key(self, seq: Sequence, now: float) -> tuple[int, int, int]:
        """Sort key, best first: effective priority, then arrival (n > 1 siblings by index)."""
        return self.effective(seq, now), seq.arrival, seq.seq_id

    def ordered(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        """`seqs` best first, stably: sequences of one effective priority keep their order."""
        return sorted(seqs, key=lambda s: self.effective(s, now))

    def mixed(self, seqs: list[Sequence]) -> bool:
        """Whether these sequences' priorities differ (else every rule here is plain FCFS)."""
        return bool(seqs) and any(s.priority != seqs[0].priority for s in seqs)


class WaitingQueue:
    """Sequences waiting for a row (new, or preempted to be recomputed), kept in arrival order;
    `ordered()` is the order they are admitted in."""

    def __init__(self, policy: PriorityPolicy) -> None:
        self.policy = policy
        self._seqs: list[Sequence] = []
        self._priorities: dict[int, int] = {}  # priority -> how many waiting sequences have it

    def push(self, seq: Sequence) -> None:
        """Queue `seq` at its arrival's place (a preempted sequence goes before every later arrival)."""
        if not self._seqs or (seq.arrival, seq.seq_id) > (self._seqs[-1].arrival, self._seqs[-1].seq_id):
            self._seqs.append(seq)
        else:
            bisect.insort(self._seqs, seq, key=lambda s: (s.arrival, s.seq_id))
        self._priorities[seq.priority] = self._priorities.get(seq.priority, 0) + 1

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)
        left = self._priorities[seq.priority] - 1
        if left:
            self._priorities[seq.priority] = left
        else:
            del self._priorities[seq.priority]

    def ordered(self, now: float) -> list[Sequence]:
        """Best first: (effective priority, arrival). One priority among them: arrival order."""
        if len(self._priorities) <= 1:
            return list(self._seqs)
        return sorted(self._seqs, key=lambda s: self.policy.key(s, now))

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs
