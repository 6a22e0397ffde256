"""Keys stored as transposed tiles: the block store's K layout where decode attention reads it with
mx.gather_mm on the CPU (float32; cache.LiveKV(keys_transposed=True), paged_attention.py).

The head-major store (cache.py) holds one layer's K as [heads, slots, dim]: block b's tile of head h
is [block_size, dim], so a decode pass's scores (the row's query heads [rep, dim] times the tile)
need the tile transposed, and OpenBLAS's small matrix products with a transposed operand take ~1.5x
as long on this CPU as untransposed ones (the default model's 30 layers at 64 rows of 144 keys:
16 -> 11 ms a step). Here the K store is [heads, blocks, dim, block_size] instead (block b of head
h is the tile [dim, block_size]); V keeps [heads, slots, dim] (its product already reads the tile
as it is). Slot s is position s % block_size of block s // block_size, as in the head-major store.

A token's K is then a column of its tile (dim elements block_size apart): it is written and read
with MLX's axis scatter and gather over the flat store (mx.put_along_axis / mx.take_along_axis with
one index per element), which on the CPU are as fast as the head-major store's slice scatter and
take (a decode step's write at 64 rows: 0.05 ms a layer; a 4,096-token prefill's: 1.1 against 3.2
ms), where an index per (head, slot) with a slice of the strided column took 6-7x as long.
What other stores take (a disk tier's block file, a fork's copied block) stays [heads,
block_size, dim] per block: `tile` and `untile` turn a block's tile around.
"""

from __future__ import annotations

import mlx.core as mx


def zeros(heads: int, slots: int, dim: int, block_size: int, dtype: mx.Dtype) -> mx.array:
    """An empty K store [heads, slots / block_size, dim, block_size]."""
    return mx.zeros((heads, slots // block_size, dim, block_size), dtype)


def flat_index(slots: mx.array, store_shape: tuple[int, ...]) -> mx.array:
    """[*slots.shape, heads, dim] flat positions in a store of `store_shape` of every (slot, head,
    element) (int32; a store's elements must fit in int32)."""
    heads, blocks, dim, block_size = store_shape
    if heads * blocks * dim * block_size >= 2**31:
        raise ValueError(f"a transposed K store of {store_shape} has too many elements for int32 indices")
    slots = slots.astype(mx.int32)
    base = (slots // block_size) * (dim * block_size) + slots % block_size  # [...]
    head = mx.arange(heads, dtype=mx.int32) * (blocks * dim * block_size)
    element = mx.arange(dim, dtype=mx.int32) * block_size
    return base[..., None, None] + head[:, None] + element  # [..., heads, dim]


def write_index(slots: mx.array, store_shape: tuple[int, ...]) -> mx.array:
    """The flat positions [heads * N * dim] that `write` stores N new tokens' K at (slots [N])."""
    return flat_index(slots, store_shape).transpose(1, 0, 2).reshape(-1)


def write(store: mx.array, new: mx.array, index: mx.array) -> mx.array:
    """The store with new K [heads, N, dim] written at `write_index` (in place when the store is
    donated, as the head-major store's scatter)."""
    flat = mx.put_along_axis(store.reshape(-1), index, new.astype(store.dtype).reshape(-1), axis=0)
    return flat.reshape(store.shape)


def gather(store: mx.array, read: mx.array, index: mx.array | None = None) -> mx.array:
    """The K of rows through their slots `read` [n, T]: [n, heads, T, dim] (`index`: read_index's
    of `read`, when the caller keeps it for several layers)."""
    n, T = read.shape
    heads, _, dim, _ = store.shape
    if index is None:
        index = read_index(read, store.shape)
    return mx.take_along_axis(store.reshape(-1), index, axis=0).reshape(n, heads, T, dim)


def read_index(read: mx.array, store_shape: tuple[int, ...]) -> mx.array:
    """The flat positions [n * heads * T * dim] `gather` reads rows' K at (read [n, T] slots)."""
    return flat_index(read, store_shape).transpose(0, 2, 1, 3).reshape(-1)


def tile(store: mx.array, blocks: mx.array) -> mx.array:
    """Blocks' K as the head-major store holds it: [heads, len(blocks) * block_size, dim] (store blocks `blocks`)."""
    tiles = mx.take(store, blocks, axis=1)  # [heads, k, dim, block_size]
    heads, k, dim, block_size = tiles.shape
    return tiles.swapaxes(-1, -2).reshape(heads, k * block_size, dim)


def untile(data: mx.array, block_size: int) -> mx.array:
    """K [heads, k * block_size, dim] (head-major) as k tiles [heads, k, dim, block_size]."""
    heads, slots, dim = data.shape
    return data.reshape(heads, slots // block_size, block_size, dim).swapaxes(-1, -2)
