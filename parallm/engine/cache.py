"""The live KV: one block store per layer, shared by every live sequence and the prefix cache
(block bookkeeping: blocks.py; packed passes' views: packed.py; paged decode attention:
paged_attention.py).

`LiveKV` holds per layer a K and a V store, head-major: [kv_heads, slots, dim] (with `kv.bits`, each
the three arrays of mx.quantize's format, kv_format.py, laid out alike). Block b of the
BlockManager is slots [(b + 1) * block_size, (b + 2) * block_size) of every head; block "-1", slots
[0, block_size), is a trash block that pad positions and unheld table entries point at. Viewed as
[kv_heads, blocks + 1, block_size, dim] (a free reshape), block b + 1 of head h is one contiguous
tile: the paged attention kernels' layout (paged_attention.py), the disk tier's block files' too.
Where decode attention reads the store with mx.gather_mm on the CPU (float32), K is stored as
transposed tiles instead (`keys_transposed`: [kv_heads, blocks + 1, dim, block_size], key_tiles.py);
the functions here (`scatter`, `gather`, the block copies and reads) take either layout, and what
leaves the store (a block's tile for the disk tier) is head-major either way.
A sequence's KV is its block table (`Sequence.block_ids`), so a prefix hit, a finished block, an
n > 1 fork and a row move are references, never copies (only a fork's partly filled last block is
copied: `copy_blocks`). The store grows (`ensure`) as far as the block ids in use reach, so its
memory follows the tokens held, not the longest row.

A pass over some sequences hands the model one `RowsView` per layer; the view satisfies mlx-lm's
cache protocol (`KVCacheProtocol` below): the model calls `update_and_fetch` with the new K/V, the
view scatters them to each token's slot (one Scatter per layer: `PassContext.write_index`) and
returns the rows' K/V gathered through their block tables (`PassContext.read`, [rows, span] slot
ids) as [rows, heads, span, dim]; the mask from `make_mask` hides every row's unused tail (and
applies sliding windows). MLX evaluates lazily: where the engine's fast-math attention reads a
decode pass through the block tables instead (`PagedDecode`, fastmath.py), nothing evaluates the
gather.

Rows stay: each live sequence has a row, the index of its per-row state (penalties, the recurrent
state of hybrid models: `LiveKV.states`, parallm.engine.state) and of its place in a pass. Without
tables (`PassContext(tables=None)`: compat checks and scratch passes), row r holds blocks
[r * nb, (r + 1) * nb) for nb = capacity / block_size: the old dense layout as a block table.

MLX arrays are values: an update is in place only when nothing else still refers to the old
array ("donation"); a kernel launched but not finished holds its inputs too: a pass that writes
the stores waits for the device first once they are large (`LiveKV.settle`).

Traps of mlx-lm's protocol, handled here: a truthy cache with `make_mask` builds the mask (the
view always returns an explicit mask, since rows differ in length); an attribute named `bits`
switches attention to the quantized path (a view has it only over quantized stores read through
the quantized matmuls, kv_format.mark); `offset` is an mx.array of per-row positions, which
mx.fast.rope accepts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from . import key_tiles, paged_kernels
from .kv_format import KV, KVFormat, mark, parts
from .memory import retry_out_of_memory
from .paged_attention import PagedRead, Way, paged_decode_attention
from .state import ListView, RowsState, SlotLayout, allocate

TRASH = -1  # the block id unheld table entries point at (store block 0)


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

    @property
    def read(self) -> mx.array:
        """[n, span] the store slot of every (row, key position): made on first use (a decode pass read
        through the block tables never gathers, so it never builds them)."""
        if self._read is None:
            if self._bound is None or self._table is None:
                raise ValueError("a pass's read slots before bind()")
            self._read = mx.array(read_slots(self._table, self._bound.block_size, self.span))
        return self._read

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


class LiveKV:
    """Per-layer K/V block stores [heads, slots, dim] shared by all live sequences and the prefix
    cache, and the per-row recurrent state of the model's state slots, if any (parallm.engine.state).
    `rows` x `capacity`: the rows of per-row state and the longest row the tables cover (Resize).
    `keys_transposed`: K as transposed tiles [heads, blocks, dim, block_size] (key_tiles.py; not with
    quantized K/V)."""

    def __init__(self, shapes: list[LayerShape], dtype: mx.Dtype, layout: SlotLayout | None = None,
                 kv_format: KVFormat | None = None, *, block_size: int = 16, max_blocks: int | None = None,
                 keys_transposed: bool = False) -> None:
        if keys_transposed and kv_format is not None and kv_format.quantized:
            raise ValueError("quantized K/V are stored head-major: keys_transposed takes the model's dtype only")
        self.keys_transposed = keys_transposed
        self.shapes = shapes
        self.dtype = dtype
        self.layout = layout
        self.format = kv_format or KVFormat(dtype)
        self.block_size = block_size
        self.max_blocks = max_blocks  # the BlockManager's blocks (None: grow as asked)
        self.rows = 0
        self.capacity = 0
        self.keys: list[KV] = []  # per layer: an array, or the quantized format's three (kv_format.py)
        self.values: list[KV] = []
        self.states: list[list[mx.array | None]] = []  # per state slot, per entry: [rows, ...]
        self.settle_bytes: float | None = None  # see settle()
        # decode passes that read the store through the CUDA kernel store their new K/V through its
        # pointer (paged_kernels.cuda_write: set by the runner once the paged read is checked), so only a
        # write made of MLX ops (a prefill's scatter, a block copy) makes a pass wait in settle()
        self.writes_in_place = False
        # with in-place writes, a decode pass stores each row's newest K/V in its attention kernel (the fused
        # variant, paged_kernels.cuda_attention's `newest`: one launch a layer) instead of a write kernel before
        # it; set by the runner with writes_in_place, where the start-up check passed with it
        self.fuses_newest = False
        self._op_written = True
        self.copied: Counter[str] = Counter()  # bytes copied by row ops, by kind ("cow": a fork's last block, "state")

    @property
    def bytes_per_token(self) -> int:
        return self.format.bytes_per_token(self.shapes)

    @property
    def store_blocks(self) -> int:
        """Blocks the store holds now (the trash block not counted)."""
        return parts(self.values[0])[0].shape[1] // self.block_size - 1 if self.values else 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K/V stores (the trash block included)."""
        return (self.store_blocks + 1) * self.block_size * self.bytes_per_token if self.keys else 0

    @property
    def nbytes(self) -> int:
        state = self.rows * self.layout.state_bytes_per_row if self.layout else 0
        return self.kv_bytes + state

    def settle(self) -> None:
        """Wait for the device's work in flight when the buffers are `settle_bytes` or larger, before a
        pass that writes into them is launched. MLX writes into a buffer in place only when nothing
        else holds it, and a kernel still running (the overlapped schedule's pass in flight, or one
        whose completion MLX has not processed yet) holds its inputs until MLX's completion handler
        runs: the write then copies the whole buffer, every layer's, every step. mx.synchronize returns
        after those handlers ran (on CUDA: the stream, then a handler queued behind theirs)."""
        if self.settle_bytes is not None and self.keys and self.nbytes >= self.settle_bytes \
                and (self._op_written or not self.writes_in_place):
            mx.synchronize()
        self._op_written = False

    def op_written(self) -> None:
        """An MLX op (not an in-place write) writes into the stores in the pass being built: settle waits."""
        self._op_written = True

    def arrays(self) -> list[mx.array]:
        """Every buffer (KV, then recurrent state): what a pass updates."""
        return self._kv() + [a for slot in self.states for a in slot if a is not None]

    def _kv(self) -> list[mx.array]:
        """Every stored K/V array: each layer's K (its parts, when quantized), then each layer's V."""
        return [a for kv in self.keys + self.values for a in parts(kv)]

    def _set(self, bufs: list[mx.array]) -> None:
        """The stored arrays after an update, in `_kv()`'s order."""
        it = iter(bufs)

        def take(kv: KV) -> KV:
            return tuple(next(it) for _ in kv) if isinstance(kv, tuple) else next(it)

        self.keys = [take(k) for k in self.keys]
        self.values = [take(v) for v in self.values]
        self._op_written = True

    def ensure(self, blocks: int) -> None:
        """Make the store hold block ids [0, blocks): grown by at least half (at most to
        `max_blocks`), keeping its content."""
        have = self.store_blocks if self.keys else -1
        if blocks <= have:
            return
        want = max(blocks, 16, have + have // 2)
        if self.max_blocks is not None:
            want = max(blocks, min(want, self.max_blocks))
        slots = (want + 1) * self.block_size
        fmt = self.format

        def grow() -> tuple[list[KV], list[KV]]:
            new_k, new_v = [], []
            for i, s in enumerate(self.shapes):
                k = key_tiles.zeros(s.k_heads, slots, s.k_dim, self.block_size, self.dtype) if self.keys_transposed \
                    else fmt.zeros((s.k_heads, slots), s.k_dim)
                v = fmt.zeros((s.v_heads, slots), s.v_dim)
                if self.keys:
                    for new, cur in ((k, self.keys[i]), (v, self.values[i])):
                        for a, b in zip(parts(new), parts(cur)):
                            a[:, :b.shape[1]] = b  # slots, or a transposed K store's blocks
                new_k.append(k)
                new_v.append(v)
            mx.eval(new_k, new_v)
            return new_k, new_v

        self.keys, self.values = retry_out_of_memory(grow)  # the old stores are freed now

    def resize(self, rows: int, capacity: int) -> None:
        """Rows of per-row state := rows (keeping the overlapping ones); tables may cover `capacity`."""
        if (rows, capacity) == (self.rows, self.capacity):
            return
        if self.layout and rows != self.rows:
            keep_r = min(rows, self.rows)
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

    def default_tables(self, row0: int, n: int, span: int) -> list[list[int]]:
        """Rows [row0, row0 + n)'s blocks in the dense layout (module docstring), the store grown to them."""
        bs = self.block_size
        per_row = -(-max(self.capacity, span) // bs)
        self.ensure((row0 + n) * per_row)
        return [list(range(r * per_row, (r + 1) * per_row)) for r in range(row0, row0 + n)]

    def pass_slots(self, tables: list[list[int]], offsets: list[int], length: int,
                   span: int) -> tuple[np.ndarray, np.ndarray]:
        """(table [n, blocks], write [n * length]): the block ids of the rows' tables over `span` key
        positions (unheld entries TRASH), and the store slot of each new token at offsets[i] + t (a
        position past `span` writes where position span - 1 does; one the table does not reach: the
        trash block), the store grown to the ids. The slots of every key position: read_slots."""
        bs = self.block_size
        n, nb = len(tables), -(-span // bs)
        table = np.full((n, nb), TRASH, dtype=np.int32)
        for i, t in enumerate(tables):
            k = min(nb, len(t))
            table[i, :k] = t[:k]
        self.ensure(int(table.max()) + 1)
        pos = np.minimum(np.asarray(offsets, dtype=np.int32)[:, None] + np.arange(length, dtype=np.int32)[None],
                         span - 1)  # [n, length]
        blk = np.take_along_axis(table, pos // bs, axis=1)
        return table, ((blk + 1) * bs + pos % bs).reshape(-1).astype(np.int32)

    def _slots(self, block_ids: list[int]) -> mx.array:
        bs = self.block_size
        return mx.array([(b + 1) * bs + t for b in block_ids for t in range(bs)], dtype=mx.int32)

    def _places(self, buf: mx.array, block_ids: list[int]) -> mx.array:
        """Where blocks `block_ids` lie along axis 1 of a stored array: slots, or a transposed K store's blocks."""
        return mx.array([b + 1 for b in block_ids], dtype=mx.int32) if buf.ndim == 4 else self._slots(block_ids)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst := block src for every (src, dst) (a fork's partly filled last block)."""
        if not pairs:
            return
        self.ensure(max(max(p) for p in pairs) + 1)
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]
        reads = [mx.take(buf, self._places(buf, src), axis=1) for buf in self._kv()]
        mx.eval(reads)
        bufs = self._kv()
        for buf, r in zip(bufs, reads):
            buf[:, self._places(buf, dst)] = r
        self._set(bufs)
        self.copied["cow"] += len(pairs) * self.block_size * self.bytes_per_token

    def block_specs(self) -> list[tuple[tuple[int, int, int], mx.Dtype]]:
        """(shape [heads, block_size, width], dtype) of one block's tile of each stored array, `_kv()`'s order."""
        heads_dims = [(s.k_heads, s.k_dim) for s in self.shapes] + [(s.v_heads, s.v_dim) for s in self.shapes]
        return [((h, self.block_size, w), dt) for h, d in heads_dims for w, dt in self.format.widths(d)]

    def read_blocks(self, block_ids: list[int]) -> list[list[mx.array]]:
        """Per block, its tile [heads, block_size, width] of each stored array (`_kv()`'s order), all
        materialized in one evaluation (the disk tier saves them)."""
        self.ensure(max(block_ids) + 1)
        out = [[key_tiles.tile(buf, self._places(buf, [b])) if buf.ndim == 4 else mx.take(buf, self._slots([b]), axis=1)
                for buf in self._kv()] for b in block_ids]
        mx.eval(out)
        return out

    def write_block(self, block_id: int, data: list[mx.array]) -> None:
        """Block `block_id` := data (per stored array, `_kv()`'s order: [heads, block_size, width])."""
        self.ensure(block_id + 1)
        bufs = self._kv()
        for buf, d in zip(bufs, data):
            buf[:, self._places(buf, [block_id])] = key_tiles.untile(d, self.block_size) if buf.ndim == 4 else d
        self._set(bufs)

    def tiles(self, layer: int) -> tuple[mx.array, mx.array]:
        """Layer `layer`'s K and V stores as paged attention reads them: [heads, blocks + 1, block_size,
        dim] each (free reshapes), K as [heads, blocks + 1, dim, block_size] where `keys_transposed`."""
        bs = self.block_size
        k, v = self.keys[layer], self.values[layer]
        k4 = k if k.ndim == 4 else k.reshape(k.shape[0], -1, bs, k.shape[-1])
        return k4, v.reshape(v.shape[0], -1, bs, v.shape[-1])

    def copy_rows(self, pairs: list[tuple[int, int]], ntokens: int | list[int] = 0) -> None:
        """Row dst := row src of the per-row state for every (src, dst), reading all sources before
        writing any destination (so a swap is two pairs). The KV is in the block tables: untouched."""
        if not self.states:
            return
        state_srcs = [[[None if a is None else mx.contiguous(a[s]) for s, _ in pairs] for a in slot]
                      for slot in self.states]
        mx.eval(state_srcs)
        for slot, slot_srcs in zip(self.states, state_srcs):
            for e, (a, entry_srcs) in enumerate(zip(slot, slot_srcs)):
                if a is None:
                    continue
                for (_, d), src in zip(pairs, entry_srcs):
                    a[d] = src
                    self.copied["state"] += src.nbytes
                slot[e] = a

    def views(self, ctx: Any) -> list[Any]:
        """One view per cache slot of the model for this pass (a PassContext; a packed pass's
        context, packed.PackedContext, makes its own)."""
        if not isinstance(ctx, PassContext):
            return ctx.views(self)
        ctx.bind(self)
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
        return mask

    def paged_attention(self, queries: mx.array, keys: Any, scale: float) -> mx.array | None:
        """Decode attention of `queries` [rows, heads, 1, dim] read through the block tables
        (paged_attention.py: a kernel where the backend has one), or None unless `keys` is what this
        view's update_and_fetch returned (a KV-sharing layer's, or another cache's). New K/V handed back
        unstored go to the fused kernel, which stores them too."""
        ctx, live, i = self._ctx, self._live, self._layer
        if self._fetched is None or keys is not self._fetched[0] or ctx.paged is None:
            return None
        k4, v4 = live.tiles(i)
        if self._newest is not None:
            xk, xv = self._newest
            self._newest = None
            out = paged_decode_attention(queries, k4, v4, ctx.paged, scale, "cuda",
                                         newest=(_as(xk, k4.dtype), _as(xv, v4.dtype), ctx.write))
            self._written = out
            return out
        # stores written in place are read by the kernel that takes the write's flag
        way = "cuda" if self._written is not None else None if ctx.paged_way == "auto" else ctx.paged_way
        return paged_decode_attention(queries, k4, v4, ctx.paged, scale, way, keys_transposed=live.keys_transposed,
                                      written=self._written)

    @property
    def state(self) -> tuple[KV, KV]:
        ctx, i = self._ctx, self._layer
        if self._written is not None or self._handed_back:  # stored in place: read after the writes
            return self._rows_kv()
        return ctx.gather(self._live.keys[i]), ctx.gather(self._live.values[i])
