"""The draft model's own KV rows (spec.mode draft), keyed by sequence: how many of each sequence's
tokens the draft has computed, and which row of its dense buffers holds them.

The rows follow the target's by sequence id, not by row index: the target's row moves (admission,
compaction, preemption, fork, abort, the prefix cache's copies) never touch them. Before a draft pass
the speculating sequences are arranged into rows [0, m) in the pass's order (one row copy each that
moved; sequences not running any more lose their rows), and each row catches up from its own length:
a new sequence (admitted, forked, resumed after preemption, or a prefix-cache hit the target did not
recompute) is prefilled here from position 0 (an n > 1 sibling copies the prompt from a sibling's row
instead: `fork`), a row that rested runs what it missed. A verify pass's
rejected positions are dropped by `rollback` (the row's length; the tail is never attended and is
overwritten). This module is the one interface to the draft's KV, so that a block store can replace
the dense buffers (issue 41) without the proposer changing.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import LiveKV, PassContext
from ..compat import ModelInfo

GROW = 256  # capacity grows in steps of this many positions


class DraftKV:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.live = LiveKV(info.shapes, info.dtype)
        self._row: dict[int, int] = {}  # seq_id -> row
        self._length: dict[int, int] = {}  # seq_id -> positions computed (the row's valid prefix)

    def length(self, key: int) -> int:
        """Positions of sequence `key` the draft has computed (0: none, it has no row)."""
        return self._length.get(key, 0)

    def arrange(self, keys: list[int], capacity: int, keep: list[int] = ()) -> None:
        """Rows [0, len(keys)) := the rows of `keys` in this order, with room for `capacity` positions
        (a key without a row gets an empty one); the rows of `keep` (resting rows) follow; every other
        row is dropped."""
        keys = list(keys) + [k for k in keep if k in self._row and k not in set(keys)]
        need_rows = max(len(keys), 1)
        need_cap = -(-capacity // GROW) * GROW
        if need_rows > self.live.rows or need_cap > self.live.capacity:
            self.live.resize(max(need_rows, self.live.rows), max(need_cap, self.live.capacity))
        moves = [(self._row[k], i) for i, k in enumerate(keys) if k in self._row and self._row[k] != i]
        if moves:
            self.live.copy_rows(moves, [self._length[keys[d]] for _, d in moves])
        self._length = {k: self._length.get(k, 0) for k in keys}
        self._row = {k: i for i, k in enumerate(keys)}

    def views(self, offsets: list[int], length: int, row0: int = 0) -> list:
        """The model's cache views for a pass of `length` tokens per row over rows [row0, row0 +
        len(offsets)), row i writing from offsets[i] on."""
        return self.live.views(PassContext(row0, offsets, length, max(offsets) + length, mask5d=self.info.mask5d))

    def advance(self, key: int, length: int) -> None:
        """Sequence `key`'s row now holds `length` computed positions."""
        self._length[key] = length

    def fork(self, src: int, dst: int, length: int) -> None:
        """Sequence `dst`'s row := positions [0, length) of `src`'s (both arranged; n > 1 siblings share
        their prompt)."""
        self.live.copy_rows([(self._row[src], self._row[dst])], length)
        self._length[dst] = length

    def rollback(self, key: int, length: int) -> None:
        """Keep positions [0, length) of `key`'s row (a verify pass rejected the rest)."""
        if key in self._length:
            self._length[key] = min(self._length[key], length)

    def forget(self, key: int) -> None:
        self._row.pop(key, None)
        self._length.pop(key, None)

    def arrays(self) -> list[mx.array]:
        return self.live.arrays()

    @property
    def nbytes(self) -> int:
        return self.live.nbytes
