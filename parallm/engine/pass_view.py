"""One forward pass's view of the live KV block store (cache.LiveKV): the pass's slots and masks
(`PassContext`), one layer view per layer as mlx-lm's models call it (`RowsView`), and the scatter
and gather the views use.

A pass over some sequences hands the model one `RowsView` per layer; the view satisfies mlx-lm's
cache protocol (`KVCacheProtocol` below): the model calls `update_and_fetch` with the new K/V, the
view scatters them to each token's slot (one Scatter per layer: `PassContext.write_index`) and
returns the rows' K/V gathered through their block tables (`PassContext.read`, [rows, span] slot
ids) as [rows, heads, span, dim]; the mask from `make_mask` hides every row's unused tail (and
applies sliding windows). MLX evaluates lazily: where the engine's fast-math attention reads a
decode pass through the block tables instead (`RowsView.paged_attention`, called by fastmath.py's
attention stand-ins), nothing evaluates the gather.

Traps of mlx-lm's protocol, handled here: a truthy cache with `make_mask` builds the mask (the
view always returns an explicit mask, since rows differ in length); an attribute named `bits`
switches attention to the quantized path (a view has it only over quantized stores read through
the quantized matmuls, kv_format.mark); `offset` is an mx.array of per-row positions, which
mx.fast.rope accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from . import key_tiles, paged_kernels
from .kv_format import KV, mark
from .paged_attention import PagedRead, PrefillRead, Way, paged_decode_attention
from .state import ListView, RowsState

if TYPE_CHECKING:
    from .cache import LiveKV


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


class WriteIndex:
    """(head, slot) int32 indices [heads, N] that store N new tokens' K/V [heads, N, width] at their
    slots with one Scatter (`buf[:, slots] = x` would build an arange of the heads and broadcast
    both indices in every layer), built once per pass and head count."""

    def __init__(self, slots: mx.array) -> None:
        self._slots = slots
        self._built: dict[int, tuple[mx.array, mx.array]] = {}
        self._flat: dict[tuple[int, ...], mx.array] = {}

    def __call__(self, heads: int) -> tuple[mx.array, mx.array]:
        found = self._built.get(heads)
        if found is None:
            shape = (heads, self._slots.shape[0])
            found = self._built[heads] = (mx.broadcast_to(mx.arange(heads, dtype=mx.int32)[:, None], shape),
                                          mx.broadcast_to(self._slots[None], shape))
        return found

    def tiles(self, store_shape: tuple[int, ...]) -> mx.array:
        """The flat element positions of the new tokens in a transposed K store (key_tiles.write_index)."""
        found = self._flat.get(store_shape)
        if found is None:
            found = self._flat[store_shape] = key_tiles.write_index(self._slots, store_shape)
        return found


class PassContext:
    """State shared by all layer views of one forward pass over rows [row0, row0 + n): per row its
    offset and block table (`tables`; None: the rows' own blocks of the dense layout)."""

    def __init__(self, row0: int, offsets: list[int], length: int, span: int, *, mask5d: bool = False,
                 lengths: list[int] | None = None, tables: list[list[int]] | None = None) -> None:
        self.row0 = row0
        self.n = len(offsets)
        self.length = length  # L: tokens per row in this pass
        self.span = span  # T: key positions attended (max offset + L)
        self.offset_list = list(offsets)
        self.offsets = mx.array(offsets, dtype=mx.int32)
        self.all_fresh = max(offsets) == 0
        self.any_fresh = min(offsets) == 0
        # each row's real tokens where a right-padded pass has shorter rows (recurrent state reads it)
        padded = lengths is not None and any(n != length for n in lengths)
        self.lengths = mx.array(lengths, dtype=mx.int32) if padded else None
        self.length_list = list(lengths) if lengths is not None else [length] * self.n
        # one new token per row and every row at the same position: every key in [0, span) is
        # visible to every query, so attention needs no mask (its fast path, e.g. batch 1)
        self.unmasked = length == 1 and min(offsets) == max(offsets) == span - 1
        self.mask5d = mask5d
        self.tables = tables
        self._masks: dict[int | None, mx.array] = {}
        self._bound: LiveKV | None = None
        self._table: np.ndarray | None = None  # [n, blocks] the rows' block ids (bind)
        self._read: mx.array | None = None
        self._read_tiles: dict[tuple[int, ...], mx.array] = {}
        self.write: mx.array | None = None  # [n * L] slot of every new token, row-major
        self.write_index: WriteIndex | None = None
        self.paged: PagedRead | None = None  # decode passes: the tables as paged attention reads them
        self.paged_way: Way | None = None  # set (by the runner) where the pass's attention reads `paged`
        self.prefill_in_place = False  # set (by the runner) where a prefill pass reads K tiles in place (`in_place`)
        self._in_place: PrefillRead | None = None

    def bind(self, live: "LiveKV") -> None:
        """Resolve the slots of this pass in `live`'s store (once)."""
        if self._bound is live:
            return
        tables = self.tables if self.tables is not None else live.default_tables(self.row0, self.n, self.span)
        self._table, write = live.pass_slots(tables, self.offset_list, self.length, self.span)
        self._read = None
        self._read_tiles = {}
        self.write = mx.array(write)
        self.write_index = WriteIndex(self.write)
        if self.length == 1:
            self.paged = PagedRead(mx.array(self._table + 1), self.offsets + 1)
        self._bound = live

    def views(self, live: "LiveKV") -> list[Any]:
        """One view per cache slot of `live`'s model for this pass (LiveKV.views)."""
        self.bind(live)
        if not live.layout:
            return [RowsView(live, i, self) for i in range(len(live.shapes))]

        def view(kind: str, i):
            if kind == "kv":
                return RowsView(live, i, self)
            if kind == "state":
                return RowsState(live.states[i], self.row0, self.offsets, self.all_fresh, self.lengths, self.any_fresh)
            return ListView([view(*sub) for sub in i])

        return [view(*slot) for slot in live.layout.slots]

    @property
    def read(self) -> mx.array:
        """[n, span] the store slot of every (row, key position): made on first use (a decode pass read
        through the block tables never gathers, so it never builds them)."""
        if self._read is None:
            if self._bound is None or self._table is None:
                raise ValueError("a pass's read slots before bind()")
            self._read = mx.array(read_slots(self._table, self._bound.block_size, self.span))
        return self._read

    @property
    def in_place(self) -> PrefillRead:
        """The prompt chunks' read of the stores in place (paged_attention.PrefillRead), made on first use."""
        if self._in_place is None:
            if self._bound is None or self._table is None:
                raise ValueError("a pass's in-place read before bind()")
            self._in_place = PrefillRead(self._table, self.offset_list, self.length_list, self.length,
                                         self._bound.block_size)
        return self._in_place

    def gather(self, store: KV) -> KV:
        """The rows' keys or values through their slots: `gather(store, self.read)`, a transposed K
        store's element positions made once per pass."""
        if isinstance(store, mx.array) and store.ndim == 4:
            index = self._read_tiles.get(store.shape)
            if index is None:
                index = self._read_tiles[store.shape] = key_tiles.read_index(self.read, store.shape)
            return key_tiles.gather(store, self.read, index)
        return gather(store, self.read)

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


def read_slots(table: np.ndarray, block_size: int, span: int) -> np.ndarray:
    """[n, span] the store slot of every key position [0, span) of rows whose block tables are `table`."""
    n, nb = table.shape
    base = (table + 1) * block_size
    return (base[:, :, None] + np.arange(block_size, dtype=np.int32)).reshape(n, nb * block_size)[:, :span]


@dataclass(frozen=True, slots=True)
class PagedMask:
    """`make_mask`'s answer in a decode pass read through the block tables: the engine's attention
    stand-ins (fastmath.py) answer it with `RowsView.paged_attention`, or attend over the gathered K/V
    under `fallback` (the boolean mask, or None) where they cannot (sinks, keys not the view's)."""

    fallback: mx.array | None


def gather(store: KV, read: mx.array) -> KV:
    """The keys or values of rows through their slots `read` [n, T]: [n, heads, T, width] per stored
    array (the reference paged read: one Gather each; a transposed K store: key_tiles.gather)."""
    if isinstance(store, tuple):
        return tuple(gather(a, read) for a in store)
    if store.ndim == 4:
        return key_tiles.gather(store, read)
    return mx.take(store, read, axis=1).transpose(1, 0, 2, 3)


def _tokens(new: mx.array) -> mx.array:
    """New K or V [n, heads, L, width] as the in-place write takes them: [heads, n * L, width], row-major
    (the order of PassContext.write)."""
    n, heads, L, width = new.shape
    return new.transpose(1, 0, 2, 3).reshape(heads, n * L, width)


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


def scatter(store: KV, new: KV, index: WriteIndex) -> KV:
    """Store the new K or V [n, heads, L, width] (each stored part) at the pass's slots (`index`)."""
    if isinstance(store, tuple):
        return tuple(scatter(a, b, index) for a, b in zip(store, new))
    n, heads, L, width = new.shape
    x = new[:, :, 0, :].transpose(1, 0, 2) if L == 1 else new.transpose(1, 0, 2, 3).reshape(heads, n * L, width)
    if store.ndim == 4:  # transposed K tiles
        return key_tiles.write(store, x, index.tiles(store.shape))
    store[index(heads)] = x
    return store


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


class RowsView(LayerView):
    """One layer's cache for one pass over rows [ctx.row0, ctx.row0 + ctx.n).

    A decode pass whose store is written in place by the fused kernel (LiveKV.fuses_newest) stores
    nothing in update_and_fetch: it hands the new keys and values back as they came, and the attention
    stand-in (paged_attention) gives them to the kernel, which stores and attends them in one launch.
    Whatever else asks for this layer's K/V in the pass (a KV-sharing layer, attention with sinks, the
    state) gets the rows' K/V, stored and gathered then (`_rows_kv`)."""

    def __init__(self, live: LiveKV, layer: int, ctx: PassContext) -> None:
        super().__init__(live, layer)
        self._ctx = ctx
        self._fetched: tuple[KV, KV] | None = None
        self._written: mx.array | None = None  # the in-place write's flag (cuda_write, or the fused kernel's output)
        self._newest: tuple[mx.array, mx.array] | None = None  # new K/V the fused kernel is still to store
        self._handed_back = False  # _fetched are the new tokens, not the rows' K/V (fused writes)
        mark(self, live.format)

    @property
    def offset(self) -> mx.array:
        return self._ctx.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KV, KV]:
        ctx, live, i = self._ctx, self._live, self._layer
        if keys.shape[0] != ctx.n or keys.shape[2] != ctx.length:
            raise ValueError(f"cache view expected [{ctx.n}, heads, {ctx.length}, dim] keys, got {keys.shape}")
        fmt = live.format
        if live.writes_in_place and ctx.paged is not None and ctx.paged_way is not None:
            if live.fuses_newest:
                self._newest = self._fetched = (keys, values)
                self._handed_back = True
                return self._fetched
            self._store_in_place(keys, values)
            return self._fetched
        live.op_written()
        k_buf = scatter(live.keys[i], fmt.encode(keys), ctx.write_index)
        v_buf = scatter(live.values[i], fmt.encode(values), ctx.write_index)
        live.keys[i], live.values[i] = k_buf, v_buf
        self._fetched = fmt.fetched(ctx.gather(k_buf)), fmt.fetched(ctx.gather(v_buf))
        return self._fetched

    def _store_in_place(self, keys: mx.array, values: mx.array) -> None:
        ctx, live, i = self._ctx, self._live, self._layer
        k_buf, v_buf = live.keys[i], live.values[i]
        self._written = paged_kernels.cuda_write(k_buf, v_buf, _tokens(keys), _tokens(values), ctx.write)
        self._fetched = paged_kernels.cuda_gather_after(k_buf, v_buf, ctx.read, self._written)

    def _rows_kv(self) -> tuple[KV, KV]:
        """The rows' K/V of this pass where update_and_fetch handed the new tokens back: stored now if
        the fused kernel has not stored them, read after its write if it has."""
        if self._handed_back:
            self._handed_back = False
            if self._newest is not None:
                keys, values = self._newest
                self._newest = None
                self._store_in_place(keys, values)
            else:
                live, i = self._live, self._layer
                self._fetched = paged_kernels.cuda_gather_after(live.keys[i], live.values[i], self._ctx.read,
                                                                self._written)
        return self._fetched

    def fetched(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """The rows' K/V where `keys` is what update_and_fetch returned (what attention that cannot read
        the block tables must take), else `keys` and `values` themselves."""
        if self._handed_back and self._fetched is not None and keys is self._fetched[0]:
            return self._rows_kv()
        return keys, values

    def keys_and_values(self) -> tuple[KV, KV]:
        """The rows' K/V of this pass (gemma3n's and afm7's KV-sharing layers read the owner layer's
        cache so)."""
        if self._fetched is None:
            raise ValueError("keys_and_values() before this pass stored any keys")
        return self._rows_kv()

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array | PagedMask | None:
        ctx = self._ctx
        if N != ctx.length:
            raise ValueError(f"mask for {N} tokens requested in a pass of {ctx.length}")
        whole = window_size is None or ctx.span <= window_size  # every held key is in the window
        mask = None if ctx.unmasked and not return_array and whole else ctx.mask(window_size)
        if ctx.paged_way is not None and ctx.paged is not None and whole and not return_array \
                and not self._live.format.quantized:
            return PagedMask(mask)
        if ctx.prefill_in_place and ctx.length > 1 and whole and not return_array and self._live.keys_transposed:
            return PagedMask(mask)
        return mask

    def paged_attention(self, queries: mx.array, keys: Any, scale: float) -> mx.array | None:
        """Decode attention of `queries` [rows, heads, 1, dim] read through the block tables
        (paged_attention.py: a kernel where the backend has one), or None unless `keys` is what this
        view's update_and_fetch returned (a KV-sharing layer's, or another cache's). New K/V handed back
        unstored go to the fused kernel, which stores them too."""
        ctx, live, i = self._ctx, self._live, self._layer
        if self._fetched is None or keys is not self._fetched[0]:
            return None
        if ctx.length > 1:  # a prefill pass's chunks (make_mask: ctx.prefill_in_place, K as transposed tiles)
            if not ctx.prefill_in_place or queries.dtype != mx.float32:
                return None
            return ctx.in_place.attend(queries, *live.tiles(i), scale)
        if ctx.paged is None:
            return None
        if live.writes_in_place:  # the CUDA kernel, over the stores themselves (no reshape op a layer)
            k_store, v_store, paged = live.keys[i], live.values[i], ctx.paged
            newest = None
            if self._newest is not None:
                xk, xv = self._newest
                self._newest = None
                newest = (_as(xk, k_store.dtype), _as(xv, v_store.dtype), ctx.write)
            out = paged_kernels.cuda_attention(queries, k_store, v_store, paged.tables, paged.lengths, scale,
                                               written=self._written, newest=newest, block_size=live.block_size)
            if newest is not None:
                self._written = out
            return out
        k4, v4 = live.tiles(i)
        way = None if ctx.paged_way == "auto" else ctx.paged_way
        return paged_decode_attention(queries, k4, v4, ctx.paged, scale, way, keys_transposed=live.keys_transposed)

    @property
    def state(self) -> tuple[KV, KV]:
        ctx, i = self._ctx, self._layer
        if self._written is not None or self._handed_back:  # stored in place: read after the writes
            return self._rows_kv()
        return ctx.gather(self._live.keys[i]), ctx.gather(self._live.values[i])
