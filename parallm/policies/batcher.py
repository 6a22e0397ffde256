"""Dynamic batching of policy requests: per (model, kind), requests are stacked up to `max_batch`
rows, and a batch leaves when it is full or when its oldest request has waited `flush_us`.

Pure Python and clock-free (the caller passes `now`, in seconds), so tests drive it exactly.
A request that shares an episode with one already in the forming batch waits for the next batch,
so that it sees the state the first one leaves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Hashable, Iterator, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Queued(Generic[T]):
    item: T
    rows: int
    arrived: float
    episodes: tuple[str, ...] = ()


@dataclass(slots=True)
class _Lane(Generic[T]):
    queue: deque[Queued[T]] = field(default_factory=deque)
    rows: int = 0


class Batcher(Generic[T]):
    def __init__(self, max_batch: int, flush_us: int) -> None:
        self.max_batch = max_batch
        self.flush_s = flush_us / 1e6
        self._lanes: dict[Hashable, _Lane[T]] = {}

    def __len__(self) -> int:
        return sum(len(lane.queue) for lane in self._lanes.values())

    @property
    def rows(self) -> int:
        """Rows waiting, over every lane."""
        return sum(lane.rows for lane in self._lanes.values())

    def add(self, key: Hashable, item: T, rows: int, now: float, episodes: tuple[str, ...] = ()) -> None:
        lane = self._lanes.setdefault(key, _Lane())
        lane.queue.append(Queued(item, rows, now, episodes))
        lane.rows += rows

    def next_deadline(self) -> float | None:
        """When the oldest waiting request's flush bound ends (None: nothing waits)."""
        oldest = [lane.queue[0].arrived for lane in self._lanes.values() if lane.queue]
        return min(oldest) + self.flush_s if oldest else None

    def due(self, now: float, flush_all: bool = False) -> Iterator[tuple[Hashable, list[T]]]:
        """Every batch that is ready at `now` (all that wait, with `flush_all`), each at most max_batch
        rows (one request larger than that goes alone)."""
        for key, lane in list(self._lanes.items()):
            while lane.queue and (flush_all or lane.rows >= self.max_batch
                                  or now - lane.queue[0].arrived >= self.flush_s):
                yield key, self._take(lane)
            if not lane.queue:
                del self._lanes[key]

    def _take(self, lane: _Lane[T]) -> list[T]:
        batch: list[T] = []
        rows = 0
        seen: set[str] = set()
        while lane.queue:
            head = lane.queue[0]
            if batch and (rows + head.rows > self.max_batch or seen.intersection(head.episodes)):
                break
            lane.queue.popleft()
            lane.rows -= head.rows
            rows += head.rows
            seen.update(head.episodes)
            batch.append(head.item)
        return batch
