"""The model's SwiGLU, attention and RoPE without MLX's slow CPU paths (libm exp, RoPE fallback).

MLX's Linux CPU build evaluates exp, sigmoid and tanh one element at a time through libm: about
13 ns an element on the 2-core CI machine, where an add or multiply takes 0.5 ns. On the default
model (float32, OpenBLAS) the SiLU of one MLP costs more than its three matmuls in a prefill pass
(5.6 ms against 3.6 ms for 225 tokens) and a third of them in a batch-16 decode step, and the
softmax of attention adds as much again over long spans. Here exp(x) = 2^n * 2^f, n = floor(x /
ln 2), with a degree-5 polynomial for 2^f on [0, 1): multiplies, adds and a floor that
`mx.compile` fuses into loops the C++ compiler vectorizes, and the power 2^n written straight
into the float's exponent bits. Relative error at most 4e-7 (float32 rounding: 6e-8).
Measured (perf/profile_fastmath.py, retired: git show 3928439:perf/profile_fastmath.py):
SwiGLU 6.1 -> 1.4 ms for 225 x 1536, 0.44 -> 0.12 ms for
16 x 1536; attention 2.9 -> 1.4 ms for a 5-row prefill chunk; the engine's prefill pass of five
45-token prompts 498 -> 354 ms, a batch-16 decode step 114 -> 107 ms.

The fast functions replace mlx-lm's `swiglu` and `scaled_dot_product_attention` in the model's
own module only while `FastMath` is entered (the engine enters it around its passes), so any
other use of mlx-lm in the process (mlx_lm.generate, a trainer's loss) keeps the stock kernels.
They take float32 only; every other case (half precision, attention sinks) goes to the stock
function. Quantized K/V (kv.bits, a cache with `bits`) get the same attention with MLX's quantized
matmuls in place of the two products (the stock quantized attention's softmax is libm's exp). Likewise the model's rotate-half RoPE modules are stood in for by
`FastRoPE` (see `RopeTables`), and the attention runs packed passes (packed.PackedContext), which
only these functions understand.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .packed import PackedMask, TokenPositions

LOG2E = 1.4426950408889634
# 2^f on [0, 1): minimax coefficients (degree 5), highest first
_POW2_COEFFS = (1.8775767e-3, 8.9893397e-3, 5.5826318e-2, 2.4015361e-1, 6.9315308e-1, 9.9999994e-1)
# exponents are clamped to [-100, 126]: 2^-100 stays a normal float after any softmax division
# (denormals make every later op ~100x slower on x86); 2^126 is the largest power that is
_MIN_EXP2, _MAX_EXP2 = -100.0, 126.0


def _pow2_fraction(f: mx.array) -> mx.array:
    p = _POW2_COEFFS[0]
    for c in _POW2_COEFFS[1:]:
        p = p * f + c
    return p


@partial(mx.compile, shapeless=True)
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) as (2^f, the int32 bit pattern of the float 2^n)."""
    t = mx.clip(x * LOG2E, _MIN_EXP2, _MAX_EXP2)
    n = mx.floor(t)
    return _pow2_fraction(t - n), (n.astype(mx.int32) + 127) << 23


@partial(mx.compile, shapeless=True)
def _exp_parts_shifted(s: mx.array, m: mx.array) -> tuple[mx.array, mx.array]:
    return _exp_parts(s - m)


def exp(x: mx.array) -> mx.array:
    """exp of a float32 array (the reinterpretation of the exponent bits cannot be compiled
    shapeless, so it sits between two fused loops)."""
    frac, bits = _exp_parts(x)
    return frac * bits.view(mx.float32)


@partial(mx.compile, shapeless=True)
def _swiglu_combine(gate: mx.array, x: mx.array, frac: mx.array, scale: mx.array) -> mx.array:
    return gate / (1.0 + frac * scale) * x


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, mlx-lm's `activations.swiglu`."""
    if gate.dtype != mx.float32 or x.dtype != mx.float32:
        return _stock_swiglu(gate, x)
    frac, bits = _exp_parts(-gate)
    return _swiglu_combine(gate, x, frac, bits.view(mx.float32))


@partial(mx.compile, shapeless=True)
def _masked_weights(frac: mx.array, scale: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask, frac * scale, 0.0)


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                                 scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `base.scaled_dot_product_attention` for float32 queries [B, heads, L, dim] and
    keys/values [B, kv_heads, T, dim] (grouped-query heads share their kv head); `mask` is None,
    "causal", a boolean array (True = visible) or an additive one, broadcastable to the scores."""
    if isinstance(mask, PackedMask):  # a packed pass (parallm.engine.packed.PackedContext)
        if sinks is not None or queries.dtype != mx.float32:
            raise ValueError("packed passes take float32 attention without sinks")
        return cache.packed.attend(queries, keys, values, scale, mask.window, scaled_dot_product_attention)
    if sinks is not None or queries.dtype != mx.float32:
        return _stock_sdpa(queries, keys, values, cache, scale, mask, sinks)
    quant = (cache.group_size, cache.bits) if hasattr(cache, "bits") else None  # keys/values: mx.quantize's parts
    scores, boolean = _grouped_scores(queries, keys, scale, mask, quant)
    return _attend_values(masked_softmax(scores, boolean), values, queries.shape, quant)


def masked_softmax(scores: mx.array, visible: mx.array | None, axis: int | tuple[int, ...] = -1) -> mx.array:
    """Softmax over `axis` (one or several) of float32 scores with this module's exp; `visible` (boolean,
    broadcastable, or None) gives the positions that count: the others get weight 0 (their
    scores must already be at most the visible ones', e.g. set to the float's min as
    _grouped_scores does)."""
    frac, bits = _exp_parts_shifted(scores, scores.max(axis, keepdims=True))
    scale_bits = bits.view(mx.float32)
    weights = _masked_weights(frac, scale_bits, visible) if visible is not None else frac * scale_bits
    return weights / weights.sum(axis, keepdims=True)


def unfused_sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention as plain matmuls and a softmax (float32 inside, in any dtype): what a prefill pass of
    a short span uses with engine.unfused_prefill_keys, instead of MLX's fused kernel, whose CUDA
    version (cuDNN) builds a graph per shape and strides."""
    scores, _ = _grouped_scores(queries, keys, scale, mask)
    return _attend_values(mx.softmax(scores, axis=-1, precise=True), values, queries.shape)


def _grouped_scores(queries: mx.array, keys: Any, scale: float, mask: Any,
                    quant: tuple[int, int] | None = None) -> tuple[mx.array, mx.array | None]:
    """Masked scores [B, kv_heads, rep, L, T] of queries [B, heads, L, dim] against keys [B,
    kv_heads, T, dim] (with `quant`, (group size, bits): mx.quantize's parts of them), and the boolean
    mask (None when there is none or it is additive)."""
    B, H, L, D = queries.shape
    first = keys[0] if quant else keys
    kv_heads, T = first.shape[1], first.shape[2]
    rep = H // kv_heads
    # the query heads sharing a kv head are stacked as rows of one matmul against it (no
    # broadcast of K or V), then viewed [B, kv_heads, rep, L, T] for the mask
    q = (queries * scale).reshape(B, kv_heads, rep * L, D)
    if quant:
        products = mx.quantized_matmul(q, *keys, transpose=True, group_size=quant[0], bits=quant[1])
    else:
        products = q @ keys.swapaxes(-1, -2)
    scores = products.reshape(B, kv_heads, rep, L, T)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = mx.arange(T)[None] <= mx.arange(T - L, T)[:, None]
    boolean = None
    if mask is not None:
        if mask.ndim == 4:  # [B or 1, heads or 1, L, T]: split the heads like the queries
            mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mask.shape[0], kv_heads, rep,
                                                                            *mask.shape[2:])
        if mask.dtype == mx.bool_:
            boolean = mask
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask.astype(scores.dtype)
    return scores, boolean


def _attend_values(weights: mx.array, values: Any, shape: tuple[int, ...],
                   quant: tuple[int, int] | None = None) -> mx.array:
    B, H, L, _ = shape
    first = values[0] if quant else values
    kv_heads, T = first.shape[1], first.shape[2]
    w = weights.reshape(B, kv_heads, (H // kv_heads) * L, T)
    if quant:
        out = mx.quantized_matmul(w, *values, transpose=False, group_size=quant[0], bits=quant[1])
    else:
        out = w @ values
    return out.reshape(B, H, L, -1)


@partial(mx.compile, shapeless=True)
def _rotate(x: mx.array, swapped: mx.array, cos: mx.array, signed_sin: mx.array) -> mx.array:
    return x * cos + swapped * signed_sin


class RopeTables:
    """cos/sin of one pass's positions, computed once and shared by every layer's RoPE.

    MLX's CPU backend has no RoPE kernel: `mx.fast.rope` runs its composed fallback (positions,
    frequencies, libm cos/sin of every (row, position, frequency), slices, four multiplies, two
    adds, a concatenate) in each layer for queries and keys alike: 114 us for a batch-16 decode
    query on this machine. The tables depend only on the positions (the cache's `offset`, one
    array per pass) and the RoPE's parameters, so they are built once per pass with the same
    operations as that fallback, and each layer's rotation is a concatenate and one fused
    multiply-add (23 us)."""

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[Any, mx.array, mx.array]] = {}

    def clear(self) -> None:
        self._tables.clear()

    def get(self, offset: Any, length: int, dims: int, base: float | None, scale: float,
            freqs: mx.array | None) -> tuple[mx.array, mx.array]:
        key = (id(offset), length, dims, base, scale, None if freqs is None else id(freqs))
        hit = self._tables.get(key)
        if hit is not None and hit[0] is offset:
            return hit[1], hit[2]
        half = dims // 2
        if isinstance(offset, TokenPositions):  # a packed pass: one position per token, [1, 1, N]
            positions = offset.positions.astype(mx.float32)[None, None] * mx.array(scale, dtype=mx.float32)
        else:
            off = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
            if off.size > 1:
                off = off.reshape(-1, 1, 1)  # [B, 1, 1]: positions [B, 1, L]
            positions = (mx.arange(length, dtype=mx.float32) + off) * mx.array(scale, dtype=mx.float32)
        if freqs is None:
            inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base) / half, dtype=mx.float32))
        else:
            inv = mx.reciprocal(freqs.astype(mx.float32))
        theta = positions[..., None] * inv
        cos, sin = mx.cos(theta), mx.sin(theta)
        table = (offset, mx.concatenate([cos, cos], -1), mx.concatenate([-sin, sin], -1))
        self._tables[key] = table
        return table[1], table[2]


def packed_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                sinks: mx.array | None = None, *, unfused_keys: int = 0, unfused_decode: bool = False) -> mx.array:
    """mlx-lm's stock attention, which also runs a packed pass (each segment with the stock kernel),
    and `unfused_sdpa` for more than one query per row over at most `unfused_keys` keys, and (with
    `unfused_decode`) for one query per row under an array mask: what FastMath(exp=False) puts in
    the model's module (a GPU's mixed passes, short prefills, masked decode)."""
    if isinstance(mask, PackedMask):
        if sinks is not None:
            raise ValueError("packed passes take attention without sinks")
        return cache.packed.attend(queries, keys, values, scale, mask.window, _stock_sdpa)
    if sinks is None and not hasattr(cache, "bits") and (
            (unfused_keys and queries.shape[2] > 1 and keys.shape[2] <= unfused_keys)
            or (unfused_decode and queries.shape[2] == 1 and isinstance(mask, mx.array))):
        return unfused_sdpa(queries, keys, values, scale, mask)
    return _stock_sdpa(queries, keys, values, cache, scale, mask, sinks)


class FastRoPE:
    """Stands in for one nn.RoPE / mlx-lm Llama3RoPE module while fast math is entered: float32
    rotate-half inputs from the tables (with `tables`), a packed pass's per-token positions
    (TokenPositions) as a batch of one-token rows with the module's own kernel (array offsets:
    the same rotation as each token alone), anything else to the module itself."""

    def __init__(self, rope: nn.Module, tables: RopeTables | None) -> None:
        self.rope = rope
        self.tables = tables
        self.dims = rope.dims
        self.base = getattr(rope, "base", None)
        self.scale = float(getattr(rope, "scale", 1.0))

    @property
    def freqs(self) -> mx.array | None:
        """Read from the module on each call: under mx.compile(inputs=model) the module's own entry is
        the traced input, and a reference kept here would be an uncaptured input (compiled.py)."""
        return getattr(self.rope, "_freqs", None)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.tables is None or x.dtype != mx.float32 or x.ndim != 4:
            if isinstance(offset, TokenPositions):
                return self._per_token(x, offset.positions)
            return self.rope(x, offset=offset)
        dims, half = self.dims, self.dims // 2
        cos, signed_sin = self.tables.get(offset, x.shape[2], dims, self.base, self.scale, self.freqs)
        head = x if dims == x.shape[-1] else x[..., :dims]
        out = _rotate(head, mx.concatenate([head[..., half:], head[..., :half]], -1), cos, signed_sin)
        return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], -1)


    def _per_token(self, x: mx.array, positions: mx.array) -> mx.array:
        if x.ndim != 4 or x.shape[0] != 1:
            raise ValueError(f"a packed pass's RoPE takes [1, heads, tokens, dim] inputs, got {x.shape}")
        rows = x[0].transpose(1, 0, 2)[:, :, None]  # [tokens, heads, 1, dim]
        return self.rope(rows, offset=positions)[:, :, 0].transpose(1, 0, 2)[None]


def _fast_ropes(model: nn.Module, tables: RopeTables | None) -> list[tuple[nn.Module, str, nn.Module, FastRoPE]]:
    """(parent, attribute, module, stand-in) for each RoPE of the model that FastRoPE can take
    (with tables: rotate-half ones only)."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    out = []
    for _, parent in model.named_modules():
        for attr, child in parent.children().items():
            if not isinstance(child, nn.Module) or (tables is not None and getattr(child, "traditional", True)):
                continue
            plain = type(child) is nn.RoPE
            llama3 = type(child) is Llama3RoPE and getattr(child, "_freqs", None) is not None
            if plain or llama3:
                out.append((parent, attr, child, FastRoPE(child, tables)))
    return out


def _stock_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    from mlx_lm.models import activations

    return activations.swiglu(gate, x)


def _stock_sdpa(*args: Any) -> mx.array:
    from mlx_lm.models import base

    return base.scaled_dot_product_attention(*args)


class FastMath:
    """While entered, the model's mlx-lm module uses the functions above (a no-op for modules
    that do not use mlx-lm's stock `swiglu` / `scaled_dot_product_attention`). With `exp` False
    only what packed passes need, and unfused attention for short prefills (`unfused_keys`) and
    masked decode (`unfused_decode`): the stock kernels for everything else (a GPU's mixed passes,
    prefills and decode)."""

    def __init__(self, model: nn.Module, *, exp: bool = True, unfused_keys: int = 0,
                 unfused_decode: bool = False) -> None:
        from mlx_lm.models import activations, base

        self.module = sys.modules.get(type(model).__module__)
        if exp:
            stock = {"swiglu": (activations.swiglu, swiglu),
                     "scaled_dot_product_attention": (base.scaled_dot_product_attention,
                                                      scaled_dot_product_attention)}
        else:
            stock = {"scaled_dot_product_attention": (base.scaled_dot_product_attention,
                                                      partial(packed_sdpa, unfused_keys=unfused_keys,
                                                              unfused_decode=unfused_decode))}
        self.replaced: dict[str, tuple[Any, Any]] = {}
        if self.module is not None:
            for name, (original, fast) in stock.items():
                if getattr(self.module, name, None) is original:
                    self.replaced[name] = (original, fast)
        self.rope_tables = RopeTables()
        self.ropes = _fast_ropes(model, self.rope_tables if exp else None)
        self._depth = 0

    @property
    def active(self) -> bool:
        return bool(self.replaced or self.ropes)

    def __enter__(self) -> "FastMath":
        if self._depth == 0:
            for name, (_, fast) in self.replaced.items():
                setattr(self.module, name, fast)
            for parent, attr, _, fast in self.ropes:
                parent[attr] = fast
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            for name, (original, _) in self.replaced.items():
                setattr(self.module, name, original)
            for parent, attr, original, _ in self.ropes:
                parent[attr] = original
            self.rope_tables.clear()
