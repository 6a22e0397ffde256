"""Float32 exp, SwiGLU and attention without MLX's slow CPU paths (libm exp), as plain functions.

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

They take float32 only; every other case (half precision, attention sinks) goes to mlx-lm's stock
function; quantized K/V (kv.bits) are read through MLX's quantized matmuls. Nothing here knows the engine: the engine's stand-ins
(parallm/engine/fastmath.py: packed passes, RoPE tables, the module swap) and the pooling package's
BERT encoder both call these.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx

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


def exp_shifted(x: mx.array, shift: mx.array) -> mx.array:
    """exp(x - shift) of float32 arrays (`shift` broadcast): a softmax's unnormalized weights, for a
    caller that takes the maximum and the sum itself (over several axes, or divides later).
    Elements at the float's min (masked) get 2^-100 against the largest's 1."""
    frac, bits = _exp_parts_shifted(x, shift)
    return frac * bits.view(mx.float32)


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
        return stock_swiglu(gate, x)
    frac, bits = _exp_parts(-gate)
    return _swiglu_combine(gate, x, frac, bits.view(mx.float32))


@partial(mx.compile, shapeless=True)
def _masked_weights(frac: mx.array, scale: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask, frac * scale, 0.0)


def scaled_dot_product_attention(queries: mx.array, keys: Any, values: Any, cache: Any,
                                 scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `base.scaled_dot_product_attention` for float32 queries [B, heads, L, dim] and
    keys/values [B, kv_heads, T, dim] (grouped-query heads share their kv head); `mask` is None,
    "causal", a boolean array (True = visible) or an additive one, broadcastable to the scores.
    Quantized K/V (kv.bits: a cache with `bits`, keys and values as mx.quantize's parts) get the same
    attention with MLX's quantized matmuls in place of the two products (the stock quantized
    attention's softmax is libm's exp)."""
    if sinks is not None or queries.dtype != mx.float32:
        return stock_sdpa(queries, keys, values, cache, scale, mask, sinks)
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


def stock_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    from mlx_lm.models import activations

    return activations.swiglu(gate, x)


def stock_sdpa(*args: Any) -> mx.array:
    from mlx_lm.models import base

    return base.scaled_dot_product_attention(*args)
