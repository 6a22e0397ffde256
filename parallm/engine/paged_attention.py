"""Decode attention read through block tables: one query token per row against that row's keys
and values in a paged block store, without copying the row's KV out first where the device allows.

The layout (head-major): per layer, K and V stores of shape [kv_heads, blocks, block_size, dim];
block b of KV head h is `store[h, b]`, one contiguous [block_size, dim] tile. A row's KV is its
block table (`tables[row]`: block ids, its first `ceil(lengths[row] / block_size)` entries in
use) and `lengths[row]` (keys held, the token just written included), both in a `PagedRead` made
once per pass. Entries past a row's blocks may name any block of the store: their keys are masked
(the kernels never read them). The stores must hold finite values (zero-initialised; the MLX-op
ways multiply masked values by 0).

With `keys_transposed` the K store is [kv_heads, blocks, dim, block_size] instead (each tile
transposed: cache.LiveKV(keys_transposed=True), key_tiles.py), what the CPU's gather_mm way reads
fastest (`transposes_keys` says where a store should be so); the MLX-op ways take either layout,
the kernels the head-major one only.

Ways (`choose_way` picks one per backend; perf/bench_paged_attention.py measured them):
- "gather": the rows' blocks gathered head-major, `store[:, tables]` ([kv_heads, rows, keys, dim],
  contiguous), two batched matmuls with the query heads of a KV head as the rows of one matmul,
  a float32 softmax. Any device and dtype: the reference the others are tested against.
- "gather_mm": the same without the copy: `mx.gather_mm` multiplies each (KV head, row)'s query
  heads by the store's key tiles in place (scores [kv_heads, rows, width, rep, block_size], the
  softmax over the row's tiles and their keys at once), and the weights by the value tiles,
  summed over the row's tiles. MLX's CPU gather_mm takes float32 only: the CPU's way for float32
  models (near the dense rows at 512 keys, the copy-gather 0.2-0.6x: perf/results/paged-attention-
  cpu*.md), over transposed K tiles there (the scores' products untransposed: 16 -> 11 ms of a
  64-row step of the default model, which puts the paged read level with the dense rows':
  perf/results/pagedkv-decode-rebased-cpu.md). On CUDA it is slow and fails at 64+ long rows
  (perf/results/paged-attention-h200-run1).
- "cuda": paged_kernels.cuda_attention (flash-decoding over the table, split-K for few long rows;
  1.3-3.5x faster than the dense rows at 64 and 256 rows on the H200).
- "metal": paged_kernels.metal_attention, only where Metal is (Apple silicon).
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import numpy as np

from parallm import kernels

from . import paged_kernels

Way = Literal["gather", "gather_mm", "cuda", "metal"]


def backend() -> str:
    """The GPU backend MLX computes on ("metal", "cuda"), or "cpu"."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else "cpu"


def choose_way(queries: mx.array, k_store: mx.array, keys_transposed: bool = False) -> Way:
    """The backend's kernel when it takes the shape (paged_kernels.kernel_fits); elsewhere
    gather_mm for float32 on the CPU, else the gather."""
    where = backend()
    if where in ("cuda", "metal") and not keys_transposed:
        return where if paged_kernels.kernel_fits(queries, k_store) else "gather"  # type: ignore[return-value]
    if where in ("cuda", "metal"):
        return "gather"
    return "gather_mm" if queries.dtype == mx.float32 else "gather"


def transposes_keys(way: str | None, dtype: mx.Dtype, quantized: bool) -> bool:
    """Whether a block store whose decode passes read it the `way` (engine.paged_decode: "auto",
    "gather_mm", "gather", None = not through the tables) should hold K as transposed tiles: where
    the reads are gather_mm's on the CPU (float32, not quantized)."""
    return way in ("auto", "gather_mm") and backend() == "cpu" and dtype == mx.float32 and not quantized


class PagedRead:
    """One pass's block tables [rows, width] and lengths [rows] (int32), with what the MLX-op ways
    derive from them (the tiles' indices, the visible keys) made once and shared by every layer."""

    def __init__(self, tables: mx.array, lengths: mx.array) -> None:
        if tables.ndim != 2 or lengths.shape != (tables.shape[0],):
            raise ValueError(f"tables [rows, width] and lengths [rows] expected, got {tables.shape} and {lengths.shape}")
        self.tables = tables.astype(mx.int32)
        self.lengths = lengths.astype(mx.int32)
        self.rows, self.width = tables.shape
        self._derived: dict[tuple, tuple[mx.array, ...]] = {}

    def visible(self, block_size: int) -> mx.array:
        """[rows, width * block_size]: which key positions each row holds."""
        key = ("visible", block_size)
        if key not in self._derived:
            keys = mx.arange(self.width * block_size, dtype=mx.int32)
            self._derived[key] = (keys[None] < self.lengths[:, None],)
        return self._derived[key][0]

    def tiles(self, kv_heads: int, blocks: int) -> tuple[mx.array, mx.array, mx.array]:
        """gather_mm's indices, each [kv_heads, rows, width]: the store tile of every (head, row, table
        entry) in stores viewed [kv_heads * blocks, ...], its queries' place in the queries viewed
        [rows * kv_heads, rep, dim] (row-major as they come: no transposed copy of them), and its own
        position (the weights' tile). Head-major like the store: the matmuls walk one head's store at
        a time (row-major indices, which would spare the output's transpose, were 6 % slower at 64 rows)."""
        key = ("tiles", kv_heads, blocks)
        if key not in self._derived:
            head = mx.arange(kv_heads, dtype=mx.uint32)[:, None, None]
            tiles = head * blocks + self.tables.astype(mx.uint32)[None]
            per_row = mx.arange(self.rows, dtype=mx.uint32)[None, :, None] * kv_heads + head + mx.zeros_like(tiles)
            own = mx.arange(tiles.size, dtype=mx.uint32).reshape(tiles.shape)
            self._derived[key] = (tiles, per_row, own)
        return self._derived[key]  # type: ignore[return-value]

    def chunk_visible(self, block_size: int, length: int) -> mx.array:
        """[1, rows, width, 1, length, block_size]: which keys the queries of a chunk of `length` tokens
        ending at each row's `lengths` see (query t of row r, at position lengths[r] - length + t, sees
        keys 0 .. that position), as gather_mm_prefill_attention's scores are laid out."""
        key = ("chunk", block_size, length)
        if key not in self._derived:
            keys = mx.arange(self.width * block_size, dtype=mx.int32).reshape(1, self.width, 1, block_size)
            last = (self.lengths - length)[:, None, None, None] + mx.arange(length, dtype=mx.int32)[None, None, :, None]
            self._derived[key] = ((keys <= last)[None, :, :, None],)
        return self._derived[key][0]


def paged_decode_attention(queries: mx.array, k_store: mx.array, v_store: mx.array, read: PagedRead,
                           scale: float, way: Way | None = None, *, keys_transposed: bool = False) -> mx.array:
    """Attention of queries [rows, heads, 1, dim] (heads a multiple of kv_heads: grouped-query
    heads h * rep .. h * rep + rep - 1 share KV head h) over each row's first `read.lengths[row]`
    keys of the stores [kv_heads, blocks, block_size, dim] (K [kv_heads, blocks, dim, block_size]
    with `keys_transposed`) through `read.tables`: [rows, heads, 1, dim] in the queries' dtype.
    `way`: None = choose_way. (Stores written in place are read with paged_kernels.cuda_attention itself:
    pass_view.RowsView.paged_attention.)"""
    rows, heads, length, dim = queries.shape
    kv_heads, _, block_size, store_dim = v_store.shape
    k_shape = v_store.shape if not keys_transposed else (kv_heads, v_store.shape[1], dim, block_size)
    if length != 1 or store_dim != dim or heads % kv_heads or k_store.shape != k_shape:
        raise ValueError(f"paged decode attention takes queries [rows, heads, 1, dim] and stores [kv_heads, "
                         f"blocks, block_size, dim] (K [kv_heads, blocks, dim, block_size] with keys_transposed); "
                         f"got {queries.shape}, {k_store.shape}, {v_store.shape}")
    if read.rows != rows:
        raise ValueError(f"the block tables have {read.rows} rows, the queries {rows}")
    way = choose_way(queries, v_store, keys_transposed) if way is None else way
    if keys_transposed and way in ("cuda", "metal"):
        raise ValueError(f"the {way} kernel reads head-major K tiles, not transposed ones")
    if way == "cuda":
        return paged_kernels.cuda_attention(queries, k_store, v_store, read.tables, read.lengths, scale)
    if way == "metal":
        return paged_kernels.metal_attention(queries, k_store, v_store, read.tables, read.lengths, scale)
    if way == "gather_mm":
        return gather_mm_attention(queries, k_store, v_store, read, scale, keys_transposed)
    return gather_attention(queries, k_store, v_store, read, scale, keys_transposed)


def _softmax(scores: mx.array, visible: mx.array, axis: int | tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """Masked softmax over `axis` in float32 (the kernels module's exp for float32 models), weights in `dtype`."""
    scores = mx.where(visible, scores.astype(mx.float32), mx.finfo(mx.float32).min)
    if dtype == mx.float32:
        return kernels.masked_softmax(scores, visible, axis)
    weights = mx.exp(scores - scores.max(axis, keepdims=True))
    return (weights / weights.sum(axis, keepdims=True)).astype(dtype)


def gather_attention(queries: mx.array, k_store: mx.array, v_store: mx.array, read: PagedRead,
                     scale: float, keys_transposed: bool = False) -> mx.array:
    """The reference way (module docstring): gather, two matmuls, a masked float32 softmax."""
    rows, heads, _, dim = queries.shape
    kv_heads, _, block_size, _ = v_store.shape
    rep = heads // kv_heads
    if keys_transposed:  # [kv_heads, rows, width, dim, block] -> [kv_heads, rows, dim, T]
        keys_t = k_store[:, read.tables].transpose(0, 1, 3, 2, 4).reshape(kv_heads, rows, dim, -1)
    else:
        keys_t = k_store[:, read.tables].reshape(kv_heads, rows, -1, dim).swapaxes(-1, -2)  # gathered contiguous
    values = v_store[:, read.tables].reshape(kv_heads, rows, -1, dim)
    q = (queries * scale).reshape(rows, kv_heads, rep, dim).transpose(1, 0, 2, 3)  # [kv_heads, rows, rep, dim]
    scores = q @ keys_t  # [kv_heads, rows, rep, T]
    visible = read.visible(block_size)[None, :, None, :]
    out = _softmax(scores, visible, -1, queries.dtype) @ values  # [kv_heads, rows, rep, dim]
    return out.transpose(1, 0, 2, 3).reshape(rows, heads, 1, dim)


def gather_mm_attention(queries: mx.array, k_store: mx.array, v_store: mx.array, read: PagedRead,
                        scale: float, keys_transposed: bool = False) -> mx.array:
    """The stores read in place by mx.gather_mm (module docstring). For float32 the softmax is left
    unnormalized until the values are summed: each maximum and sum is taken over the tile's keys,
    then over the row's tiles (two reductions of contiguous runs, not one over two strided axes),
    the boolean mask is applied once (a masked key's weight is 2^-100 of the largest, not 0: the
    stores hold finite values), and the division falls on the output [rows, heads, dim] instead of on
    every weight (the default model's 30 layers at 64 rows of 144 keys: 43-45 -> 38-40 ms a step)."""
    rows, heads, _, dim = queries.shape
    kv_heads, blocks, block_size, _ = v_store.shape
    rep, width = heads // kv_heads, read.width
    tiles, per_row, own = read.tiles(kv_heads, blocks)
    q = (queries * scale).reshape(rows * kv_heads, rep, dim)
    # each tile's scores: the row's query heads [rep, dim] times its keys [dim, block]: [kv_heads, rows, width, rep, block]
    k_tiles = k_store.reshape(kv_heads * blocks, dim, block_size) if keys_transposed else \
        k_store.reshape(kv_heads * blocks, block_size, dim).swapaxes(-1, -2)
    scores = mx.gather_mm(q, k_tiles, lhs_indices=per_row, rhs_indices=tiles)
    visible = read.visible(block_size).reshape(1, rows, width, 1, block_size)
    total = None
    if queries.dtype == mx.float32:
        scores = mx.where(visible, scores, mx.finfo(mx.float32).min)
        weights = kernels.exp_shifted(scores, scores.max(4, keepdims=True).max(2, keepdims=True))
        total = weights.sum(4).sum(2)  # [kv_heads, rows, rep]
    else:
        weights = _softmax(scores, visible, (2, 4), queries.dtype)  # over the row's tiles and their keys
    # each tile's weights [rep, block] times its values [block, dim], summed over the tiles
    out = mx.gather_mm(weights.reshape(kv_heads * rows * width, rep, block_size),
                       v_store.reshape(kv_heads * blocks, block_size, dim),
                       lhs_indices=own, rhs_indices=tiles)  # [kv_heads, rows, width, rep, dim]
    if total is not None:
        out = out.sum(2) / total[..., None]
    else:
        out = out.sum(2) if out.dtype == mx.float32 else out.astype(mx.float32).sum(2).astype(out.dtype)
    return out.transpose(1, 0, 2, 3).reshape(rows, heads, 1, dim)


def gather_mm_prefill_attention(queries: mx.array, k_store: mx.array, v_store: mx.array, read: PagedRead,
                                scale: float) -> mx.array:
    """Prompt chunks' attention, read in place as `gather_mm_attention` reads a decode pass's: queries
    [rows, heads, L, dim] (float32; row r's chunk ends at read.lengths[r], its query t sees the keys up
    to its own position) over K stored as transposed tiles [kv_heads, blocks, dim, block_size] and V
    [kv_heads, blocks, block_size, dim] through `read.tables` (entries past a row's keys are masked;
    the tiles' indices and the mask made once a pass, shared by every layer). The rows' K/V are never
    gathered: on the 2-core CPU a 16-token chunk at position 5,000 of the default model attended in
    9.9 ms a layer this way against 20.4 ms gathered then attended (the late chunks of a long prompt
    are mostly that: issue 30's canary)."""
    rows, heads, length, dim = queries.shape
    kv_heads, blocks, block_size, v_dim = v_store.shape
    if queries.dtype != mx.float32 or k_store.shape != (kv_heads, blocks, dim, block_size) or heads % kv_heads:
        raise ValueError(f"prefill attention in place takes float32 queries and transposed K tiles; got "
                         f"{queries.dtype} {queries.shape}, {k_store.shape}, {v_store.shape}")
    if read.rows != rows:
        raise ValueError(f"the block tables have {read.rows} rows, the queries {rows}")
    rep, width = heads // kv_heads, read.width
    tiles, per_row, own = read.tiles(kv_heads, blocks)
    q = (queries * scale).reshape(rows * kv_heads, rep * length, dim)
    scores = mx.gather_mm(q, k_store.reshape(kv_heads * blocks, dim, block_size), lhs_indices=per_row,
                          rhs_indices=tiles).reshape(kv_heads, rows, width, rep, length, block_size)
    scores = mx.where(read.chunk_visible(block_size, length), scores, mx.finfo(mx.float32).min)
    weights = kernels.exp_shifted(scores, scores.max(5, keepdims=True).max(2, keepdims=True))
    total = weights.sum(5).sum(2)  # [kv_heads, rows, rep, length]
    out = mx.gather_mm(weights.reshape(kv_heads * rows * width, rep * length, block_size),
                       v_store.reshape(kv_heads * blocks, block_size, v_dim), lhs_indices=own, rhs_indices=tiles)
    out = out.sum(2).reshape(kv_heads, rows, rep, length, v_dim) / total[..., None]
    return out.transpose(1, 0, 2, 3, 4).reshape(rows, heads, length, v_dim)


CHUNK_SPAN_RATIO = 4  # a pass's chunks are read in place where their span is at least this many chunk lengths


def chunks_read_in_place(length: int, span: int) -> bool:
    """Whether a pass of `length`-token chunks attending over `span` keys reads the store in place (where the
    engine can): where the span is long against the chunk, gathering it is most of the attention; for short
    spans the two ways were within 0.8-1.25x of each other (a millisecond a layer; 2-row 40-token chunks
    from position 0: 1.25x in place, one 128-token chunk 1.16x) on the 2-core CPU, the default model's heads."""
    return length > 1 and CHUNK_SPAN_RATIO * length <= span


class PrefillRead:
    """A prefill pass's rows for `gather_mm_prefill_attention`, in groups of like spans: each group is
    attended over its widest row's table, so a short prompt beside a long prompt's late chunk is a group
    of its own (attended together, each row would read the long one's span: issue 30's canary). Made
    once a pass from its tables `table` [rows, blocks] (block ids, cache.TRASH past a row's own), the
    rows' chunk starts and real lengths, and the pass's (padded) chunk length."""

    def __init__(self, table: np.ndarray, starts: list[int], lengths: list[int], length: int,
                 block_size: int) -> None:
        need = [max(1, -(-(s + n) // block_size)) for s, n in zip(starts, lengths)]
        order = sorted(range(len(need)), key=lambda i: -need[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and 2 * need[i] >= need[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        groups = [sorted(g) for g in groups]  # one group: the pass's own row order
        whole = len(groups) == 1
        self.groups = [(None if whole else mx.array(g, dtype=mx.int32),
                        PagedRead(mx.array(table[g, :max(need[i] for i in g)] + 1),
                                  mx.array([starts[i] + length for i in g], dtype=mx.int32))) for g in groups]
        self.unorder = None if whole else mx.argsort(mx.array([i for g in groups for i in g], dtype=mx.int32))

    def attend(self, queries: mx.array, k_store: mx.array, v_store: mx.array, scale: float) -> mx.array:
        """Attention of the pass's queries [rows, heads, L, dim] over the stores (K as transposed tiles
        [kv_heads, blocks, dim, block_size], V [kv_heads, blocks, block_size, dim])."""
        parts = [gather_mm_prefill_attention(queries if rows is None else queries[rows], k_store, v_store, read, scale)
                 for rows, read in self.groups]
        return parts[0] if self.unorder is None else mx.concatenate(parts)[self.unorder]
