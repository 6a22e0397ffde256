"""How K and V are stored (`kv.bits`): in the model's dtype, or quantized with `mx.quantize` as
mlx-lm's QuantizedKVCache stores them (per token and head: the packed values, uint32, and one scale
and one bias per `kv.group_size` elements, in the model's dtype).

Every store of K/V (the block store of the live sequences and the prefix cache, cache.LiveKV; the
disk tier's block files) holds, per layer, K then V as one array each in the model's dtype, or as the
three arrays (values, scales, biases) of the quantized format. Each array is [heads, slots, width]
(a block file: [heads, block_size, width]), so a prefix hit is a reference and a fork's copied block
or a block read from disk moves the stored parts as they are: nothing is re-quantized, and only a
token's own K/V is quantized, once, when its pass stores it.

Attention reads the quantized K/V in one of two ways (`read`): "matmul", MLX's quantized matmuls over
the stored parts (mlx-lm's `quantized_scaled_dot_product_attention`, which a cache with a `bits`
attribute switches a model's stock attention to), or "dequantize", the rows' K/V dequantized into
the model's dtype for whatever attention the model runs (models whose attention is written by hand,
e.g. gemma2's). compat.kv_format_for picks the first that runs the model and agrees with the other.
On the CPU the engine's fast-math attention runs the quantized matmuls with its own softmax
(fastmath.scaled_dot_product_attention); one layer's decode attention at smollm2's shape then costs
about what the dense one does, and dequantizing first costs more (perf/bench_kv_bits.py, "attention").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence, Union

import mlx.core as mx

KV = Union[mx.array, tuple[mx.array, ...]]  # one layer's K (or V): an array, or (values, scales, biases)
ReadMode = Literal["matmul", "dequantize"]
BITS = (4, 8)


def parts(kv: KV) -> tuple[mx.array, ...]:
    """The stored arrays of one K or V."""
    return kv if isinstance(kv, tuple) else (kv,)


@dataclass(frozen=True, slots=True)
class KVFormat:
    dtype: mx.Dtype   # the model's: K/V when not quantized, scales and biases when quantized
    bits: int = 0     # 0: not quantized
    group_size: int = 64
    read: ReadMode = "matmul"

    @property
    def quantized(self) -> bool:
        return self.bits != 0

    def widths(self, dim: int) -> list[tuple[int, mx.Dtype]]:
        """(last dimension, dtype) of each stored array of a K or V of `dim` elements per head."""
        if not self.quantized:
            return [(dim, self.dtype)]
        groups = dim // self.group_size
        return [(dim * self.bits // 32, mx.uint32), (groups, self.dtype), (groups, self.dtype)]

    def bytes_per_token(self, shapes: Sequence[Any]) -> int:
        """Bytes one token's K and V take in every layer (shapes: cache.LayerShape)."""
        total = 0
        for s in shapes:
            for heads, dim in ((s.k_heads, s.k_dim), (s.v_heads, s.v_dim)):
                total += heads * sum(w * dt.size for w, dt in self.widths(dim))
        return max(1, total)

    def zeros(self, lead: tuple[int, ...], dim: int) -> KV:
        """An empty store [*lead, width] of K or V of `dim` elements per head."""
        arrays = tuple(mx.zeros((*lead, w), dt) for w, dt in self.widths(dim))
        return arrays if self.quantized else arrays[0]

    def encode(self, x: mx.array) -> KV:
        """K or V [..., dim] as stored."""
        if not self.quantized:
            return x
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, kv: KV) -> mx.array:
        """Stored K or V back in the model's dtype."""
        if not isinstance(kv, tuple):
            return kv
        return mx.dequantize(*kv, group_size=self.group_size, bits=self.bits)

    def fetched(self, kv: KV) -> KV:
        """What attention reads of stored K/V: the stored arrays (matmul) or their dequantization."""
        return self.decode(kv) if self.quantized and self.read == "dequantize" else kv

    @property
    def marks_cache(self) -> bool:
        """Whether a layer's cache view carries `bits` and `group_size` (mlx-lm's stock attention then
        runs its quantized matmuls over what the view fetched)."""
        return self.quantized and self.read == "matmul"

    def check(self, shapes: Sequence[Any]) -> None:
        """ValueError naming the flag when the model's heads cannot be quantized in these groups."""
        if not self.quantized:
            return
        if self.bits not in BITS:
            raise ValueError(f"--kv.bits {self.bits} is not supported (8, 4, or 0 for the model's dtype)")
        dims = sorted({d for s in shapes for d in (s.k_dim, s.v_dim)})
        bad = [d for d in dims if d % self.group_size or (d * self.bits) % 32]
        if bad:
            raise ValueError(f"--kv.group-size {self.group_size} does not divide the model's K/V head dimension "
                             f"{bad[0]}; use a group size that divides {', '.join(map(str, dims))}")


def slice_kv(kv: KV, index: Any) -> KV:
    """kv[index] for each stored array."""
    return tuple(a[index] for a in kv) if isinstance(kv, tuple) else kv[index]


def mark(view: Any, fmt: KVFormat) -> None:
    """Give a cache view the attributes that route a model's stock attention to the quantized matmuls."""
    if fmt.marks_cache:
        view.bits, view.group_size = fmt.bits, fmt.group_size

