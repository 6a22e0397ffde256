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
the functions that write and read it (pass_view's `scatter` and `gather`, the block copies and reads
here) take either layout, and what leaves the store (a block's tile for the disk tier) is head-major either way.
A sequence's KV is its block table (`Sequence.block_ids`), so a prefix hit, a finished block, an
n > 1 fork and a row move are references, never copies (only a fork's partly filled last block and a
partial prefix hit's block are copied: `copy_blocks`). The store grows (`ensure`) as far as the block
ids in use reach, so its memory follows the tokens held, not the longest row.

Rows stay: each live sequence has a row, the index of its per-row state (penalties, the recurrent
state of hybrid models: `LiveKV.states`, parallm.engine.state) and of its place in a pass. Without
tables (`PassContext(tables=None)`: compat checks and scratch passes), row r holds blocks
[r * nb, (r + 1) * nb) for nb = capacity / block_size: the old dense layout as a block table.

MLX arrays are values: an update is in place only when nothing else still refers to the old
array ("donation"); a kernel launched but not finished holds its inputs too: a pass that writes
the stores waits for the device first once they are large (`LiveKV.settle`).

One pass's view of the store (`PassContext`, the layer views mlx-lm's models call): pass_view.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from . import key_tiles
from .kv_format import KV, KVFormat, parts
from .memory import retry_out_of_memory
from .state import SlotLayout, allocate

TRASH = -1  # the block id unheld table entries point at (store block 0)


@dataclass(frozen=True, slots=True)
class LayerShape:
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    @property
    def elems_per_token(self) -> int:
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim


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
        """Block dst := block src for every (src, dst): a fork's partly filled last block, a partial
        prefix hit's block."""
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
        """One view per cache slot of the model for a pass, made by the pass's context
        (pass_view.PassContext; a packed pass's: packed.PackedContext)."""
        return ctx.views(self)
