"""The draft model's own KV rows (spec.mode draft), keyed by sequence: how many of each sequence's
tokens the draft has computed, and which row of its dense buffers holds them.

The rows follow the target's by sequence id, not by row index: the target's row moves and its KV
store (admission, compaction, preemption, fork, abort, the prefix cache, the block store of issue 41)
never touch them. Before a draft pass the speculating sequences are arranged into rows [0, m) in the
pass's order (one row copy each that moved; resting rows keep theirs after them; sequences not running
any more lose their rows), and each row catches up from its own length: a new sequence (admitted,
resumed after preemption, or a prefix-cache hit the target did not recompute) is prefilled here from
position 0 (an n > 1 sibling copies the prompt from a sibling's row instead: `fork`), a row that
rested runs what it missed. A verify pass's rejected positions are dropped by `rollback` (the row's
length; the tail is never attended and is overwritten).

The buffers are this module's own ([rows, kv_heads, capacity, head_dim] per layer, the draft's dtype)
and so is the view a pass hands the draft model (`DraftView`: mlx-lm's cache protocol over rows at
their own offsets), so nothing here depends on how the target's KV is stored; putting the draft's
rows into the target's block store (one memory budget) is a change of this module alone.
"""

from __future__ import annotations

import mlx.core as mx

from ..compat import ModelInfo

GROW = 256  # capacity grows in steps of this many positions


class DraftKV:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.rows = 0
        self.capacity = 0
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
        rows, cap = max(len(keys), 1), -(-capacity // GROW) * GROW
        if rows > self.rows or cap > self.capacity:
            self._resize(max(rows, self.rows), max(cap, self.capacity))
        moves = [(self._row[k], i, self._length[k]) for i, k in enumerate(keys) if k in self._row and self._row[k] != i]
        self._copy(moves)
        self._length = {k: self._length.get(k, 0) for k in keys}
        self._row = {k: i for i, k in enumerate(keys)}

    def views(self, offsets: list[int], length: int, row0: int = 0) -> list["DraftView"]:
        """The draft model's cache views for a pass of `length` tokens per row over rows [row0, row0 +
        len(offsets)), row i writing from offsets[i] on."""
        ctx = _Pass(row0, offsets, length, self.info.mask5d)
        return [DraftView(self, i, ctx) for i in range(len(self.keys))]

    def advance(self, key: int, length: int) -> None:
        """Sequence `key`'s row now holds `length` computed positions."""
        self._length[key] = length

    def fork(self, src: int, dst: int, length: int) -> None:
        """Sequence `dst`'s row := positions [0, length) of `src`'s (both arranged; n > 1 siblings share
        their prompt)."""
        self._copy([(self._row[src], self._row[dst], length)])
        self._length[dst] = length

    def rollback(self, key: int, length: int) -> None:
        """Keep positions [0, length) of `key`'s row (a verify pass rejected the rest)."""
        if key in self._length:
            self._length[key] = min(self._length[key], length)

    def forget(self, key: int) -> None:
        self._row.pop(key, None)
        self._length.pop(key, None)

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def _resize(self, rows: int, capacity: int) -> None:
        def grown(old: mx.array | None, heads: int, dim: int) -> mx.array:
            new = mx.zeros((rows, heads, capacity, dim), self.info.dtype)
            if old is not None and self.rows and self.capacity:
                new[:self.rows, :, :self.capacity] = old
            return new

        olds = list(zip(self.keys, self.values)) or [(None, None)] * len(self.info.shapes)
        self.keys = [grown(k, s.k_heads, s.k_dim) for (k, _), s in zip(olds, self.info.shapes)]
        self.values = [grown(v, s.v_heads, s.v_dim) for (_, v), s in zip(olds, self.info.shapes)]
        mx.eval(self.keys, self.values)
        self.rows, self.capacity = rows, capacity

    def _copy(self, moves: list[tuple[int, int, int]]) -> None:
        """Row dst := row src, positions [0, n), for every (src, dst, n), all sources read first."""
        moves = [(s, d, n) for s, d, n in moves if n > 0]
        if not moves:
            return
        bufs = self.arrays()
        srcs = [[mx.contiguous(b[s, :, :n]) for s, _, n in moves] for b in bufs]
        mx.eval(srcs)
        for b, got in zip(bufs, srcs):
            for (_, d, n), src in zip(moves, got):
                b[d, :, :n] = src
        half = len(bufs) // 2
        self.keys, self.values = bufs[:half], bufs[half:]


class _Pass:
    """What the layer views of one draft pass share: rows, offsets, write indices, masks."""

    def __init__(self, row0: int, offsets: list[int], length: int, mask5d: bool) -> None:
        self.row0, self.n, self.length, self.mask5d = row0, len(offsets), length, mask5d
        self.span = max(offsets) + length
        self.offsets = mx.array(offsets, dtype=mx.int32)
        self.positions = self.offsets[:, None] + mx.arange(length, dtype=mx.int32)[None]  # [n, L]
        self.rows = mx.arange(row0, row0 + self.n, dtype=mx.int32)[:, None]
        self._masks: dict[int | None, mx.array] = {}

    def mask(self, window: int | None) -> mx.array:
        m = self._masks.get(window)
        if m is None:
            k = mx.arange(self.span, dtype=mx.int32)
            m = k[None, None, :] <= self.positions[:, :, None]  # [n, L, T]
            if window is not None:
                m = m & (k[None, None, :] > self.positions[:, :, None] - window)
            m = self._masks[window] = m[:, None] if not self.mask5d else m[:, None, None]
        return m


class DraftView:
    """One layer's cache for one draft pass: mlx-lm's protocol (offset, update_and_fetch, make_mask)
    over the pass's rows, each at its own offset."""

    def __init__(self, kv: DraftKV, layer: int, ctx: _Pass) -> None:
        self._kv, self._layer, self._ctx = kv, layer, ctx

    def __bool__(self) -> bool:
        return True

    @property
    def offset(self) -> mx.array:
        return self._ctx.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        ctx, kv, i = self._ctx, self._kv, self._layer
        where = (ctx.rows, ctx.positions)  # [n, 1] and [n, L]: buf[rows, :, positions] is [n, L, heads, dim]
        k_buf, v_buf = kv.keys[i], kv.values[i]
        k_buf[where[0], :, where[1]] = keys.transpose(0, 2, 1, 3)
        v_buf[where[0], :, where[1]] = values.transpose(0, 2, 1, 3)
        kv.keys[i], kv.values[i] = k_buf, v_buf
        rows = slice(ctx.row0, ctx.row0 + ctx.n)
        return k_buf[rows, :, :ctx.span], v_buf[rows, :, :ctx.span]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self._ctx.mask(window_size)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        ctx, i = self._ctx, self._layer
        rows = slice(ctx.row0, ctx.row0 + ctx.n)
        return self._kv.keys[i][rows, :, :ctx.span], self._kv.values[i][rows, :, :ctx.span]

    @property
    def nbytes(self) -> int:
        return self._kv.nbytes

    def is_trimmable(self) -> bool:
        return False
