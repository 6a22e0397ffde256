"""Whether a model's decode passes read the block store through paged attention (pass_view.PagedMask,
paged_attention.py) instead of attending over the rows' gathered K/V: only where the engine's
attention stand-ins replaced the model module's stock attention (fastmath.FastMath.replaced: a model
with attention of its own gets the boolean mask and the gather), and once checked on this model
against the gather (a decode pass of two rows at different lengths on a scratch store)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import mlx.core as mx

from parallm.device import exact_float32

from .cache import LiveKV
from .pass_view import PassContext
from .paged_attention import choose_way

log = logging.getLogger("parallm.engine")

# The largest logit difference a paged read may show against the gather, relative to the largest logit
# (at least 1), for 16-bit and float32 models: the two ways round differently (a kernel accumulates in
# float32, a GPU's float32 matmuls may use TF32), so their logits differ by rounding that grows with the
# model's depth and logit scale (the H200's CUDA kernel on a 28-layer bfloat16 model: 0.19 of 5.5, 3.5 %;
# float32 matmuls there use TF32 unless MLX_ENABLE_TF32=0); a read that misses the newest key or scales the
# scores by 1.25 differs by 32 % / 10 % (tests/test_engine_paged_decode.py).
CHECK_TOLERANCE = {False: 5e-2, True: 5e-3}


def check_tolerance(dtype: mx.Dtype) -> float:
    """CHECK_TOLERANCE for a model of `dtype` on this backend: float32 through TF32 matmuls (CUDA's default)
    rounds like a 16-bit model."""
    return CHECK_TOLERANCE[dtype == mx.float32 and exact_float32()]


def replaces_attention(context: Any) -> bool:
    """Whether a FastMath context puts its attention stand-in into the model's module."""
    return context is not None and "scaled_dot_product_attention" in context.replaced


def check_paged_decode(call_model: Callable[..., mx.array], info: Any, kv_format: Any, block_size: int,
                       vocab: int, way: str, keys_transposed: bool = False, in_place: bool = False,
                       fused: bool = False) -> bool:
    """Logits of a two-row decode pass read through the block tables (`way`) against the same pass
    over the gathered K/V, on scratch stores laid out as the engine's (`keys_transposed`); False
    (and why, logged) where they differ or it fails; `in_place`: the paged pass stores its K/V as the
    engine's would, through the CUDA kernel's in-place writes (paged_kernels.cuda_write; `fused`: by the
    attention kernel itself, LiveKV.fuses_newest): then two paged steps, the second reading what the first
    stored in place."""
    if kv_format.quantized:
        return False

    def store(writes_in_place: bool) -> LiveKV:
        live = LiveKV(info.shapes, info.dtype, kv_format=kv_format, block_size=block_size,
                      keys_transposed=keys_transposed)
        live.writes_in_place = writes_in_place
        live.fuses_newest = writes_in_place and fused
        live.resize(2, 32)
        return live

    # in place: two steps on a store of their own, the second reading what the first stored, against a store
    # the scatter wrote; otherwise one step on one store (the paged pass rewrites what the gathered one wrote)
    paged = store(in_place)
    reference = store(False) if in_place else paged
    ids = [[(seed * 7919 + j * 104729) % vocab for j in range(7)] for seed in (1, 2)]
    m5 = info.mask5d
    try:
        prompt = mx.array([ids[0][:5] + [0, 0], ids[1]])
        for live in [paged] if reference is paged else [reference, paged]:
            mx.eval(call_model(prompt, live.views(PassContext(0, [0, 0], 7, 7, mask5d=m5))), live.arrays())
        diff, scale = 0.0, 1.0
        steps = (([5, 7], [[ids[0][5]], [ids[1][0]]]), ([6, 8], [[ids[0][6]], [ids[1][1]]]))
        for offsets, step in steps[:2 if in_place else 1]:
            span = max(offsets) + 1
            want = call_model(mx.array(step), reference.views(PassContext(0, offsets, 1, span, mask5d=m5)),
                              paged=True)[:, -1]
            mx.eval(want, reference.arrays())
            ctx = PassContext(0, offsets, 1, span, mask5d=m5)
            ctx.paged_way = way  # type: ignore[assignment]
            got = call_model(mx.array(step), paged.views(ctx), paged=True)[:, -1]
            mx.eval(got, paged.arrays())
            diff = max(diff, mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item())
            scale = max(scale, mx.abs(want.astype(mx.float32)).max().item())
        ok = diff <= check_tolerance(info.dtype) * scale
        shown = resolved_way(info, block_size) if way == "auto" else way
        how = (", K/V stored by the attention kernel" if fused else ", K/V written in place") if in_place else ""
        log.info("paged decode attention %s (%s%s): logits within %.4g of the gathered K/V's (largest logit %.4g)",
                 "on" if ok else "off", shown, how, diff, scale)
        return ok
    except Exception as e:  # noqa: BLE001 - a model whose attention does not take the paged mask
        log.info("paged decode attention off: %s: %s", type(e).__name__, e)
        return False


def check_paged_prefill(call_model: Callable[..., mx.array], info: Any, kv_format: Any, block_size: int,
                        vocab: int) -> bool:
    """Logits of a two-row prefill pass whose chunks attend over K tiles read in place
    (PassContext.prefill_in_place: paged_attention.PrefillRead) against the same pass over the gathered
    K/V, on a scratch store laid out as the CPU engine's (K as transposed tiles); rows of unlike spans,
    so the pass attends in two groups. False (and why, logged) where they differ or it fails (a model
    whose attention does not take the engine's stand-in, or reads its cache otherwise)."""
    if kv_format.quantized:
        return False
    live = LiveKV(info.shapes, info.dtype, kv_format=kv_format, block_size=block_size, keys_transposed=True)
    live.resize(2, 4 * block_size)
    first, chunk = 3 * block_size + 5, 4
    ids = [[(seed * 7919 + j * 104729) % vocab for j in range(first + chunk)] for seed in (1, 2)]
    m5 = info.mask5d
    try:
        mx.eval(call_model(mx.array([ids[0][:first]]), live.views(PassContext(0, [0], first, first, mask5d=m5))),
                live.arrays())
        tokens = mx.array([ids[0][first:first + chunk], ids[1][:chunk]])
        offsets, span = [first, 0], first + chunk
        want = call_model(tokens, live.views(PassContext(0, offsets, chunk, span, mask5d=m5)))
        mx.eval(want, live.arrays())
        ctx = PassContext(0, offsets, chunk, span, mask5d=m5)
        ctx.prefill_in_place = True
        got = call_model(tokens, live.views(ctx), paged=True)
        mx.eval(got, live.arrays())
        diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        scale = max(1.0, mx.abs(want.astype(mx.float32)).max().item())
        ok = diff <= check_tolerance(info.dtype) * scale
        log.info("prompt chunks attending in place %s: logits within %.4g of the gathered K/V's (largest logit %.4g)",
                 "on" if ok else "off", diff, scale)
        return ok
    except Exception as e:  # noqa: BLE001 - a model whose attention does not take the paged mask
        log.info("prompt chunks attending in place off: %s: %s", type(e).__name__, e)
        return False


def resolved_way(info: Any, block_size: int) -> str:
    """The way "auto" reads this model's block store on this backend: the GPU's kernel where it takes
    every layer's shape (K and V of one width), else what paged_attention.choose_way says for the first."""
    ways = set()
    for shape in info.shapes:
        queries = mx.zeros((1, shape.k_heads, 1, shape.k_dim), dtype=info.dtype)
        store = mx.zeros((shape.k_heads, 1, block_size, shape.k_dim), dtype=info.dtype)
        ways.add(choose_way(queries, store) if shape.k_dim == shape.v_dim and shape.k_heads == shape.v_heads
                 else "gather")
    return ways.pop() if len(ways) == 1 else "gather"
