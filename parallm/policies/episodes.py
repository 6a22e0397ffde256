"""Recurrent state kept server-side per episode: (model, episode id) -> each state tensor's row.

An entry not used for `ttl_s` is dropped (its episode starts again from zeros); past `max_entries`
the least recently used go first. Pure Python; the policy stage calls `expire` between batches.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

import numpy as np

Key = tuple[str, str]


class EpisodeStore:
    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[Key, tuple[dict[str, np.ndarray], float]] = OrderedDict()
        self.expired = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def gather(self, model: str, episodes: list[str], starts: list[bool],
               zeros: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state rows of `episodes` (zeros for a new one or one that `starts`), stacked per tensor."""
        out = {name: np.repeat(z[None], len(episodes), axis=0) for name, z in zeros.items()}
        for i, episode in enumerate(episodes):
            entry = None if starts and starts[i] else self._entries.get((model, episode))
            if entry is not None:
                for name, row in entry[0].items():
                    out[name][i] = row
        return out

    def scatter(self, model: str, episodes: list[str], state: Mapping[str, np.ndarray], now: float) -> None:
        """Keep each episode's new state row (copied out of the batch), marked used at `now`."""
        for i, episode in enumerate(episodes):
            key = (model, episode)
            self._entries[key] = ({name: np.array(t[i]) for name, t in state.items()}, now)
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evicted += 1

    def end(self, model: str, episodes: list[str]) -> None:
        for episode in episodes:
            self._entries.pop((model, episode), None)

    def expire(self, now: float) -> int:
        """Drop entries unused for ttl_s (the oldest are first); how many went."""
        gone = 0
        while self._entries:
            key, (_, used) = next(iter(self._entries.items()))
            if now - used < self.ttl_s:
                break
            del self._entries[key]
            gone += 1
        self.expired += gone
        return gone

    def drop_model(self, model: str) -> None:
        """Forget every episode of a model (its state no longer fits new weights' shapes, or it went)."""
        for key in [k for k in self._entries if k[0] == model]:
            del self._entries[key]
