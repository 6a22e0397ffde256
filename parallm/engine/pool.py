"""The prefix cache's physical storage: per layer, K and V blocks of block_size tokens that live
rows copy into (write-backs) and out of (prefix loads), in the live KV's format (kv_format.py:
quantized K/V are stored as they are, so a prefix hit is never re-quantized)."""

from __future__ import annotations

import mlx.core as mx

from .cache import LayerShape
from .kv_format import KVFormat, parts


class KVPool:
    """Physical storage of prefix-cache blocks: per stored array [num_blocks, heads, block_size, width]."""

    def __init__(self, shapes: list[LayerShape], dtype: mx.Dtype, num_blocks: int, block_size: int,
                 kv_format: KVFormat | None = None) -> None:
        self.shapes = shapes
        self.dtype = dtype
        self.format = kv_format or KVFormat(dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.arrays: list[mx.array] = []  # K of every layer (its parts, when quantized), then V

    def allocate(self) -> None:
        """Commit the pool's memory now (zero-filling GBs takes a while: do it at start-up)."""
        self._ensure()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.format.bytes_per_token(self.shapes)

    def block_specs(self) -> list[tuple[tuple[int, int, int], mx.Dtype]]:
        """(shape [heads, block_size, width], dtype) of one block's part of each stored array, in order."""
        heads_dims = [(s.k_heads, s.k_dim) for s in self.shapes] + [(s.v_heads, s.v_dim) for s in self.shapes]
        return [((h, self.block_size, w), dt) for h, d in heads_dims for w, dt in self.format.widths(d)]

    def _ensure(self) -> None:
        if self.arrays or not self.num_blocks:
            return
        bs, fmt = self.block_size, self.format
        ks = [a for s in self.shapes for a in parts(fmt.zeros((self.num_blocks, s.k_heads, bs), s.k_dim))]
        vs = [a for s in self.shapes for a in parts(fmt.zeros((self.num_blocks, s.v_heads, bs), s.v_dim))]
        self.arrays = ks + vs
        mx.eval(self.arrays)

    def write(self, block_ids: list[int], data: list[mx.array]) -> None:
        """Blocks := data (per stored array: [heads, n * block_size, width], already materialized), the
        copy started at once. Left lazy, the writes waited for the next prefix load's evaluation, which ran
        every write queued since: a 6k-token prompt's 375 blocks (276 MB of the default model's KV, 0.26 s
        on the CPU) landed in the schedule phase of a later short request's step (issue 30: a canary's
        250 ms, in a phase after the long prompt's), and `data` was held until then."""
        self._ensure()
        ids = mx.array(block_ids, dtype=mx.int32)
        n, bs = len(block_ids), self.block_size
        out = []
        for buf, d in zip(self.arrays, data):
            h, _, dim = d.shape
            buf[ids] = d.reshape(h, n, bs, dim).transpose(1, 0, 2, 3)
            out.append(buf)
        self.arrays = out
        mx.async_eval(out)

    def read_many(self, groups: list[list[int]]) -> list[list[mx.array]]:
        """Per group of blocks, [heads, n * block_size, width] per stored array of those blocks in
        order, all materialized in one evaluation."""
        self._ensure()
        bs = self.block_size
        out = []
        for block_ids in groups:
            ids = mx.array(block_ids, dtype=mx.int32)
            n = len(block_ids)
            group = []
            for buf in self.arrays:
                g = buf[ids]  # [n, heads, bs, dim]
                group.append(g.transpose(1, 0, 2, 3).reshape(g.shape[1], n * bs, g.shape[3]))
            out.append(group)
        mx.eval(out)
        return out
