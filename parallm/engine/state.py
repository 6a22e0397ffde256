"""Per-row recurrent state (linear attention, SSM, short convolutions) beside the live KV rows.

A hybrid mlx-lm model gives some layers an `ArraysCache` (a few arrays per sequence: conv state,
recurrent state) instead of a KV cache. The engine keeps one `[rows, ...]` array per entry of each
such slot (`LiveKV.states`, resized, row-copied for n > 1 forks and row moves by the row ops, while
the KV stays in the block store) and hands the model, per pass over rows [row0, row0 + n), a `RowsState` view:

- it is an `ArraysCache` (mamba writes its state back only `if isinstance(cache, ArraysCache)`);
- `cache[i]` reads the rows' slice; a row at position 0 of its sequence reads zeros (what a fresh
  mlx-lm cache's None becomes), so a row reused after another sequence never sees its state, and
  a pass where every row starts reads None, as a new mlx-lm cache does;
- `cache[i] = v` writes the slice back (same donation discipline as the KV buffers);
- `lengths` holds each row's real tokens in a right-padded prefill pass (a row idle in the pass
  has 0), which the lengths-aware models (gated delta-net, Mamba2, short conv, ...) use to stop
  their scan at a row's end; the load-time check refuses the models that ignore it.

Semantics the engine keeps: a row's state is that of all its computed tokens, so preemption by
recompute re-prefills from position 0 and abort just frees the row. The state after a prefix
cannot be rebuilt from KV blocks, so a model with state runs without the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


@dataclass(frozen=True, slots=True)
class StateShape:
    """One ArraysCache slot: per entry, the per-row shape and dtype (None: an entry the model never sets)."""

    entries: tuple[tuple[tuple[int, ...], mx.Dtype] | None, ...]

    @property
    def bytes_per_row(self) -> int:
        total = 0
        for e in self.entries:
            if e is not None:
                n = 1
                for d in e[0]:
                    n *= d
                total += n * e[1].size
        return total


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """What each cache slot of the model is: ("kv", index into the KV shapes), ("state", index
    into the state shapes) or ("list", (sub-slots...)) for an mlx-lm CacheList."""

    slots: tuple[tuple[str, int], ...]
    states: tuple[StateShape, ...]

    @property
    def state_bytes_per_row(self) -> int:
        return sum(s.bytes_per_row for s in self.states)


def allocate(shape: StateShape, rows: int) -> list[mx.array | None]:
    return [None if e is None else mx.zeros((rows,) + e[0], e[1]) for e in shape.entries]


class RowsState(ArraysCache):
    """One ArraysCache slot's view for one pass (module docstring).

    What a decode step does not need costs it nothing: when no row of the pass starts its
    sequence (every decode pass) a read is the rows' slice alone, with no zeroing of fresh rows;
    a read is built once until the entry is written (a gated delta-net layer reads its conv state
    twice); a write casts only when the dtype differs (perf/results/state-views-cpu.md counted it)."""

    def __init__(self, arrays: list[mx.array | None], row0: int, offsets: mx.array, all_fresh: bool,
                 lengths: mx.array | None, any_fresh: bool = True) -> None:
        self._arrays = arrays  # the live list: writes replace its entries
        self._r0, self._r1 = row0, row0 + offsets.shape[0]
        self._offsets = offsets
        self._any_fresh = any_fresh  # some row of the pass is at position 0 (reads zeros)
        self._all_fresh = all_fresh
        self._written: set[int] = set()
        self._read: dict[int, mx.array] = {}
        self.lengths = lengths
        self.left_padding = None

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._arrays)

    def __getitem__(self, i: int) -> mx.array | None:
        if i >= len(self._arrays):
            raise IndexError(i)
        a = self._arrays[i]
        if a is None or (self._all_fresh and i not in self._written):
            return None
        rows = self._read.get(i)
        if rows is None:
            rows = a[self._r0:self._r1]
            if self._any_fresh and i not in self._written:
                fresh = (self._offsets == 0).reshape((-1,) + (1,) * (rows.ndim - 1))
                rows = mx.where(fresh, mx.zeros_like(rows), rows)
            self._read[i] = rows
        return rows

    def __setitem__(self, i: int, value: mx.array) -> None:
        a = self._arrays[i]
        if a is None:
            raise ValueError(f"state entry {i} was not seen when the model was probed")
        a[self._r0:self._r1] = value if value.dtype == a.dtype else value.astype(a.dtype)
        self._arrays[i] = a
        self._written.add(i)
        self._read.pop(i, None)

    def advance(self, N: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - N

    def make_mask(self, N: int, **_) -> mx.array | None:
        if self.lengths is None:
            return None
        return mx.arange(N)[None] < self.lengths[:, None]

    @property
    def state(self) -> list[mx.array | None]:
        return [None if a is None else a[self._r0:self._r1] for a in self._arrays]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays if a is not None)

    def is_trimmable(self) -> bool:
        return False


class ListView:
    """An mlx-lm CacheList of views (several caches for one layer, e.g. falcon_h1's state and KV)."""

    def __init__(self, caches: list) -> None:
        self.caches = caches

    def __getitem__(self, i: int):
        return self.caches[i]

    def __bool__(self) -> bool:
        return True

    def is_trimmable(self) -> bool:
        return False
