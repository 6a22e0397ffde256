"""The live KV cache: one dense buffer per layer, one row per live sequence (the prefix pool: pool.py;
packed passes' views: packed.py).

`LiveKV` holds per-layer K and V arrays of shape [rows, kv_heads, capacity, head_dim]. Each
row belongs to one sequence and has its own length (no left padding). A pass over a range of
rows hands the model one `RowsView` per layer; the view satisfies mlx-lm's cache protocol
(`KVCacheProtocol` below): the model calls `update_and_fetch` with the new K/V, the view
scatters them into each row at that row's own positions (one scatter per layer) and returns
the rows sliced to the longest live length T, so attention reads each row's KV once; the mask
from `make_mask` hides every row's unused tail (and applies sliding windows).

MLX arrays are values: an update is in place only when nothing else still refers to the old
array ("donation"). Every read of a buffer that is not an attention read of the updated array
(row copies, write-backs) is therefore materialized with `mx.eval` before the next update;
otherwise MLX silently copies the whole buffer (measured: 49 ms instead of 2 ms for a row move
over 30 layers, docs/engine.md). A kernel launched but not finished holds its inputs too: a pass
that writes the buffers waits for the device first once they are large (`LiveKV.settle`).

With `kv.bits` the buffers hold K/V quantized (kv_format.py): each layer's K and V are then the
three arrays of mx.quantize's format, each laid out [rows, heads, capacity, width] like a dense
buffer, so every row operation below moves them alike; a pass quantizes only its new tokens.

Traps of mlx-lm's protocol, handled here: a truthy cache with `make_mask` builds the mask (the
view always returns an explicit mask, since rows differ in length); an attribute named `bits`
switches attention to the quantized path (a view has it only over quantized buffers read through
the quantized matmuls, kv_format.mark); `offset` is an mx.array of per-row positions, which
mx.fast.rope accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from .kv_format import KV, KVFormat, mark, parts, slice_kv
from .memory import retry_out_of_memory
from .state import ListView, RowsState, SlotLayout, allocate


def write_index(rows: mx.array, positions: mx.array, heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """(row, head, position) int32 indices, each of shape positions.shape + [heads], that store
    the new K/V of every (row, position) in every head with one Scatter and nothing else.

    The obvious `buf[rows, :, positions] = kv` turns the head slice between two index arrays into a
    uint32 arange, so MLX promotes all three indices to int64 and broadcasts and casts each: 13
    graph nodes and 5 kernels per write, twice per layer and pass (a batch-1 decode of a 28-layer
    model launched ~280 kernels for them, on a GPU where the decode step is launch-bound). Built
    once per pass and head count, the layers' writes are one Scatter each (perf/results/kv-writes-cpu.md)."""
    shape = (*positions.shape, heads)
    row_idx = rows.reshape(*rows.shape, *[1] * (positions.ndim - rows.ndim), 1)
    return (mx.broadcast_to(row_idx, shape), mx.broadcast_to(mx.arange(heads, dtype=mx.int32), shape),
            mx.broadcast_to(positions[..., None], shape))


class WriteIndex:
    """A pass's `write_index` of its rows and positions, built once per head count the layers ask for."""

    def __init__(self, rows: mx.array, positions: mx.array) -> None:
        self._rows, self._positions = rows, positions
        self._built: dict[int, tuple[mx.array, mx.array, mx.array]] = {}

    def __call__(self, heads: int) -> tuple[mx.array, mx.array, mx.array]:
        found = self._built.get(heads)
        if found is None:
            found = self._built[heads] = write_index(self._rows, self._positions, heads)
        return found


@runtime_checkable
class KVCacheProtocol(Protocol):
    """What an mlx-lm attention layer uses of its cache (mlx_lm.models.cache.KVCache)."""

    @property
    def offset(self) -> Any:
        """Positions of the first new token: an int, or an mx.array with one entry per row."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store keys/values [B, kv_heads, L, head_dim]; return all keys/values to attend over."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The attention mask for N new tokens (None, "causal" or an array broadcastable to scores)."""

    @property
    def state(self) -> Any: ...

    @property
    def nbytes(self) -> int: ...

    def __bool__(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class LayerShape:
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    @property
    def elems_per_token(self) -> int:
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim


class PassContext:
    """State shared by all layer views of one forward pass over rows [row0, row0 + n)."""

    def __init__(self, row0: int, offsets: list[int], length: int, span: int, *, mask5d: bool = False,
                 lengths: list[int] | None = None) -> None:
        self.row0 = row0
        self.n = len(offsets)
        self.length = length  # L: tokens per row in this pass
        self.span = span  # T: key positions attended (max offset + L)
        self.offsets = mx.array(offsets, dtype=mx.int32)
        self.all_fresh = max(offsets) == 0
        self.any_fresh = min(offsets) == 0
        # each row's real tokens where a right-padded pass has shorter rows (recurrent state reads it)
        padded = lengths is not None and any(n != length for n in lengths)
        self.lengths = mx.array(lengths, dtype=mx.int32) if padded else None
        # one new token per row and every row at the same position: every key in [0, span) is
        # visible to every query, so attention needs no mask (its fast path, e.g. batch 1)
        self.unmasked = length == 1 and min(offsets) == max(offsets) == span - 1
        self.mask5d = mask5d
        self.rows = mx.arange(row0, row0 + self.n, dtype=mx.int32)
        if length == 1:
            self.positions = self.offsets
        else:
            self.positions = self.offsets[:, None] + mx.arange(length, dtype=mx.int32)[None]
        self._masks: dict[int | None, mx.array] = {}
        self.write_index = WriteIndex(self.rows, self.positions)  # where the new K/V of `heads` heads go

    def mask(self, window: int | None) -> mx.array:
        m = self._masks.get(window)
        if m is None:
            q = self.offsets[:, None] + mx.arange(self.length, dtype=mx.int32)[None]  # [n, L]
            k = mx.arange(self.span, dtype=mx.int32)
            m = k[None, None, :] <= q[:, :, None]  # [n, L, T]
            if window is not None:
                m = m & (k[None, None, :] > q[:, :, None] - window)
            m = m[:, None] if not self.mask5d else m[:, None, None]
            self._masks[window] = m
        return m


class LayerView:
    """What both kinds of layer view answer alike (a truthy cache, sized, never trimmed)."""

    def __init__(self, live: "LiveKV", layer: int) -> None:
        self._live = live
        self._layer = layer

    def __bool__(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self._live.nbytes // max(1, len(self._live.shapes))

    def is_trimmable(self) -> bool:
        return False


class LiveKV:
    """Per-layer dense K/V buffers [rows, heads, capacity, dim] for all live sequences, and the
    per-row recurrent state of the model's state slots, if any (parallm.engine.state)."""

    def __init__(self, shapes: list[LayerShape], dtype: mx.Dtype, layout: SlotLayout | None = None,
                 kv_format: KVFormat | None = None) -> None:
        self.shapes = shapes
        self.dtype = dtype
        self.layout = layout
        self.format = kv_format or KVFormat(dtype)
        self.rows = 0
        self.capacity = 0
        self.keys: list[KV] = []  # per layer: an array, or the quantized format's three (kv_format.py)
        self.values: list[KV] = []
        self.states: list[list[mx.array | None]] = []  # per state slot, per entry: [rows, ...]
        self.settle_bytes: float | None = None  # see settle()

    @property
    def bytes_per_token(self) -> int:
        return self.format.bytes_per_token(self.shapes)

    @property
    def nbytes(self) -> int:
        state = self.rows * self.layout.state_bytes_per_row if self.layout else 0
        return self.rows * self.capacity * self.bytes_per_token + state

    def settle(self) -> None:
        """Wait for the device's work in flight when the buffers are `settle_bytes` or larger, before a
        pass that writes into them is launched. MLX writes a slice into a buffer in place only when
        nothing else holds it, and a kernel still running (the overlapped schedule's pass in flight, or
        one whose completion MLX has not processed yet) holds its inputs until MLX's completion handler
        runs: the write then copies the whole buffer, every layer's, every step. mx.synchronize returns
        after those handlers ran (on CUDA: the stream, then a handler queued behind theirs)."""
        if self.settle_bytes is not None and self.rows and self.nbytes >= self.settle_bytes:
            mx.synchronize()

    def arrays(self) -> list[mx.array]:
        """Every buffer (KV, then recurrent state): what a pass updates."""
        return self._kv() + [a for slot in self.states for a in slot if a is not None]

    def _kv(self) -> list[mx.array]:
        """Every stored K/V array: each layer's K (its parts, when quantized), then each layer's V."""
        return [a for kv in self.keys + self.values for a in parts(kv)]

    def resize(self, rows: int, capacity: int) -> None:
        """Reallocate to rows x capacity, keeping the overlapping content."""
        if (rows, capacity) == (self.rows, self.capacity):
            return
        keep_r, keep_c = min(rows, self.rows), min(capacity, self.capacity)

        def allocate() -> tuple[list[mx.array], list[mx.array]]:
            new_k, new_v = [], []
            for i, s in enumerate(self.shapes):
                k = self.format.zeros((rows, s.k_heads, capacity), s.k_dim)
                v = self.format.zeros((rows, s.v_heads, capacity), s.v_dim)
                if keep_r and keep_c:
                    for new, old in ((k, self.keys[i]), (v, self.values[i])):
                        for a, b in zip(parts(new), parts(old)):
                            a[:keep_r, :, :keep_c] = b[:keep_r, :, :keep_c]
                new_k.append(k)
                new_v.append(v)
            mx.eval(new_k, new_v)
            return new_k, new_v

        self.keys, self.values = retry_out_of_memory(allocate)  # the old buffers are freed now
        if self.layout and rows != self.rows:
            self.states = retry_out_of_memory(lambda: self._resized_states(rows, keep_r))
        self.rows, self.capacity = rows, capacity

    def _resized_states(self, rows: int, keep_r: int) -> list[list[mx.array | None]]:
        new = [allocate(shape, rows) for shape in self.layout.states]
        for old_slot, new_slot in zip(self.states, new):
            for old, a in zip(old_slot, new_slot):
                if a is not None and old is not None and keep_r:
                    a[:keep_r] = old[:keep_r]
        mx.eval(new)
        return new

    def copy_rows(self, pairs: list[tuple[int, int]], ntokens: int | list[int]) -> None:
        """Row dst := row src (positions [0, ntokens), one count for all pairs or one per pair) for
        every (src, dst), reading all sources before writing any destination (so a swap is two
        pairs), in one evaluation."""
        counts = ntokens if isinstance(ntokens, list) else [ntokens] * len(pairs)
        ns = [max(1, min(n, self.capacity)) for n in counts]
        srcs = [[mx.contiguous(buf[s, :, :n]) for (s, _), n in zip(pairs, ns)] for buf in self._kv()]
        state_srcs = [[[None if a is None else mx.contiguous(a[s]) for s, _ in pairs] for a in slot]
                      for slot in self.states]
        mx.eval(srcs, state_srcs)
        bufs = self._kv()
        for j, buf in enumerate(bufs):
            for (_, d), src, n in zip(pairs, srcs[j], ns):
                buf[d, :, :n] = src
        self._set(bufs)
        for slot, slot_srcs in zip(self.states, state_srcs):
            for e, (a, entry_srcs) in enumerate(zip(slot, slot_srcs)):
                if a is None:
                    continue
                for (_, d), src in zip(pairs, entry_srcs):
                    a[d] = src
                slot[e] = a

    def _set(self, bufs: list[mx.array]) -> None:
        """The stored arrays after an update, in `_kv()`'s order."""
        it = iter(bufs)

        def take(kv: KV) -> KV:
            return tuple(next(it) for _ in kv) if isinstance(kv, tuple) else next(it)

        self.keys = [take(k) for k in self.keys]
        self.values = [take(v) for v in self.values]

    def read_positions(self, row: int, positions: mx.array, *, materialize: bool = True) -> list[mx.array]:
        """Copies of a row's KV at `positions` (per stored array, `_kv()`'s order: [heads, n, width]); the caller
        must evaluate them before the next update of the buffers when `materialize` is False."""
        out = [mx.take(buf[row], positions, axis=1) for buf in self._kv()]
        if materialize:
            mx.eval(out)
        return out

    def write_prefix(self, row: int, data: list[mx.array]) -> None:
        """Positions [0, n) of a row := data (per stored array, `_kv()`'s order: [heads, n, width])."""
        bufs = self._kv()
        for buf, d in zip(bufs, data):
            buf[row, :, :d.shape[1]] = d
        self._set(bufs)

    def views(self, ctx: Any) -> list[Any]:
        """One view per cache slot of the model for this pass (a PassContext; a packed pass's
        context, packed.PackedContext, makes its own)."""
        if not isinstance(ctx, PassContext):
            return ctx.views(self)
        if not self.layout:
            return [RowsView(self, i, ctx) for i in range(len(self.shapes))]

        def view(kind: str, i):
            if kind == "kv":
                return RowsView(self, i, ctx)
            if kind == "state":
                return RowsState(self.states[i], ctx.row0, ctx.offsets, ctx.all_fresh, ctx.lengths, ctx.any_fresh)
            return ListView([view(*sub) for sub in i])

        return [view(*slot) for slot in self.layout.slots]


class RowsView(LayerView):
    """One layer's cache for one pass over rows [ctx.row0, ctx.row0 + ctx.n)."""

    def __init__(self, live: LiveKV, layer: int, ctx: PassContext) -> None:
        super().__init__(live, layer)
        self._ctx = ctx
        self._fetched: tuple[KV, KV] | None = None
        mark(self, live.format)

    @property
    def offset(self) -> mx.array:
        return self._ctx.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KV, KV]:
        ctx, live, i = self._ctx, self._live, self._layer
        if keys.shape[0] != ctx.n or keys.shape[2] != ctx.length:
            raise ValueError(f"cache view expected [{ctx.n}, heads, {ctx.length}, dim] keys, got {keys.shape}")
        fmt = live.format
        where = ctx.write_index(keys.shape[1])
        k_buf = scatter_kv(live.keys[i], fmt.encode(keys), where, ctx.length == 1)
        v_buf = scatter_kv(live.values[i], fmt.encode(values), where, ctx.length == 1)
        live.keys[i], live.values[i] = k_buf, v_buf
        rows = (slice(ctx.row0, ctx.row0 + ctx.n), slice(None), slice(None, ctx.span))
        self._fetched = fmt.fetched(slice_kv(k_buf, rows)), fmt.fetched(slice_kv(v_buf, rows))
        return self._fetched

    def keys_and_values(self) -> tuple[KV, KV]:
        """What the last update_and_fetch returned (gemma3n's and afm7's KV-sharing layers read
        the owner layer's cache so)."""
        if self._fetched is None:
            raise ValueError("keys_and_values() before this pass stored any keys")
        return self._fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array | None:
        ctx = self._ctx
        if N != ctx.length:
            raise ValueError(f"mask for {N} tokens requested in a pass of {ctx.length}")
        if ctx.unmasked and not return_array and (window_size is None or ctx.span <= window_size):
            return None
        return ctx.mask(window_size)

    @property
    def state(self) -> tuple[KV, KV]:
        ctx, i = self._ctx, self._layer
        rows = (slice(ctx.row0, ctx.row0 + ctx.n), slice(None), slice(None, ctx.span))
        return slice_kv(self._live.keys[i], rows), slice_kv(self._live.values[i], rows)


def scatter_kv(buf: KV, new: KV, where: tuple[mx.array, mx.array, mx.array], one_token: bool) -> KV:
    """Store the new K or V [rows, heads, L, width] (each stored part) at `where` (write_index)."""
    if isinstance(buf, tuple):
        return tuple(scatter_kv(b, n, where, one_token) for b, n in zip(buf, new))
    buf[where] = new[:, :, 0, :] if one_token else new.transpose(0, 2, 1, 3)
    return buf
