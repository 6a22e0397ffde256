"""Paged decode attention as one GPU kernel per layer (CUDA through `mx.fast.cuda_kernel`, Metal
through `mx.fast.metal_kernel`): each threadblock attends one (row, KV head) for the query heads
that share it, walking the row's blocks through its block table with an online softmax, so no
row's K/V is ever gathered into a copy. parallm.engine.paged_attention says when they run and
holds the layout they read (and the gather they are tested against).

CUDA (flash-decoding): a warp takes one block of the row at a time; `G = D / VEC` lanes hold one
key (VEC = one 16-byte load per lane), so a warp reads `32 / G` keys per load, a block's keys
and values in a few coalesced loads, and keeps per lane group a running max, sum and output for
its query heads; the warps of a threadblock and the lane groups of a warp are merged at the end.
With `splits` > 1 (few long rows: fewer threadblocks than the GPU has room for) each split takes
a share of the row's blocks and writes float32 partials that a second kernel merges. Checked
against the gather on the H200 (tests/test_paged_attention.py's CUDA test: |diff| <= 9.5e-4 in
float32, one bfloat16 ulp in bfloat16); 168 registers a thread in bfloat16 (nvcc -Xptxas -v).

Fused (`cuda_attention(newest=...)`): the same walk over all but each row's newest key, which split 0
stores at the row's slot and its warp 0 attends from registers, so a decode pass with in-place writes
is one launch a layer (docs/engine.md, "Writing the block store in place on CUDA"). Every variant's
source is compiled with nvcc for sm_90 where nvcc is installed (tests/test_paged_kernels_nvcc.py).

Metal: the same walk with one simdgroup per block and scalar loads, no splits; it runs only on
Apple silicon (the caller's guard) and is tested only there: not run yet (no Mac here).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import mlx.core as mx

LOG2E = 1.4426950408889634
WARPS = 4  # warps (simdgroups) per threadblock
TARGET_BLOCKS = 512  # threadblocks a pass should give the GPU before splitting rows (H100/H200: 132 SMs)
SPLIT_BLOCKS = 128  # blocks (2,048 keys) a split takes at least: below, the merge's launch costs more than it saves

_CUDA_WALK = """
    constexpr int VEC = 16 / sizeof(T);
    constexpr int G = D / VEC;        // lanes per key
    constexpr int KPW = 32 / G;       // keys per warp load
    constexpr int STEPS = BS / KPW;   // warp loads per block
    constexpr int CH = STEPS < 8 ? STEPS : 8;
    using Vec = AlignedVector<T, VEC>;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int grp = lane / G;
    const int sub = lane % G;
    const int row = blockIdx.y / HKV;
    const int h = blockIdx.y % HKV;
    const int split = blockIdx.z;
    const int splits = gridDim.z;
    const int len = lengths[row] - NEW;  // keys walked in the store (NEW: the newest comes from xk, xv)
    const int maxb = tables_shape[1];
    const long nb_store = k_shape[1] / SLOTS;  // blocks of the store (SLOTS: its axis 1 counts slots, not tiles)
    const int nblk = min((len + BS - 1) / BS, maxb);
    const int per = (maxb + splits - 1) / splits;
    const int b0 = split * per;
    const int b1 = min(b0 + per, nblk);
    const float sc = scale[0];

    float qf[REP][VEC];
    float m[REP], l[REP], o[REP][VEC];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
        Vec qv = *reinterpret_cast<const Vec*>(q + Q_AT(row, h * REP + r) + sub * VEC);
#pragma unroll
        for (int i = 0; i < VEC; ++i) { qf[r][i] = static_cast<float>(qv[i]) * sc; o[r][i] = 0.f; }
        m[r] = -1e30f;
        l[r] = 0.f;
    }
    STORE_NEWEST
    const int* trow = tables + (long)row * maxb;
    for (int b = b0 + warp; b < b1; b += WARPS) {
        const long base = ((long)h * nb_store + trow[b]) * (BS * D) + sub * VEC;
#pragma unroll
        for (int c = 0; c < STEPS; c += CH) {
            Vec kr[CH], vr[CH];
#pragma unroll
            for (int s = 0; s < CH; ++s) {
                const long off = base + (long)((c + s) * KPW + grp) * D;
                kr[s] = *reinterpret_cast<const Vec*>(k + off);
                vr[s] = *reinterpret_cast<const Vec*>(v + off);
            }
            float sco[REP][CH];
#pragma unroll
            for (int s = 0; s < CH; ++s) {
                const bool valid = b * BS + (c + s) * KPW + grp < len;
#pragma unroll
                for (int r = 0; r < REP; ++r) {
                    float d = 0.f;
#pragma unroll
                    for (int i = 0; i < VEC; ++i) d += qf[r][i] * static_cast<float>(kr[s][i]);
#pragma unroll
                    for (int x = G / 2; x > 0; x >>= 1) d += __shfl_xor_sync(0xffffffff, d, x);
                    sco[r][s] = valid ? d : -1e30f;  // masked: never above a real score, never accumulated
                }
            }
#pragma unroll
            for (int r = 0; r < REP; ++r) {
                float mx_ = m[r];
#pragma unroll
                for (int s = 0; s < CH; ++s) mx_ = fmaxf(mx_, sco[r][s]);
                const float f = exp2f(m[r] - mx_);
                m[r] = mx_;
                l[r] *= f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) o[r][i] *= f;
            }
#pragma unroll
            for (int s = 0; s < CH; ++s) {
                if (b * BS + (c + s) * KPW + grp < len) {
#pragma unroll
                    for (int r = 0; r < REP; ++r) {
                        const float p = exp2f(sco[r][s] - m[r]);
                        l[r] += p;
#pragma unroll
                        for (int i = 0; i < VEC; ++i) o[r][i] += p * static_cast<float>(vr[s][i]);
                    }
                }
            }
        }
    }
    NEWEST_KEY
    // merge the lane groups of the warp (they share `sub`, so lanes x and x ^ G*j hold the same slice)
#pragma unroll
    for (int x = G; x < 32; x <<= 1) {
#pragma unroll
        for (int r = 0; r < REP; ++r) {
            const float mo = __shfl_xor_sync(0xffffffff, m[r], x);
            const float lo = __shfl_xor_sync(0xffffffff, l[r], x);
            const float mn = fmaxf(m[r], mo);
            const float fa = exp2f(m[r] - mn), fb = exp2f(mo - mn);
            l[r] = l[r] * fa + lo * fb;
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                const float oo = __shfl_xor_sync(0xffffffff, o[r][i], x);
                o[r][i] = o[r][i] * fa + oo * fb;
            }
            m[r] = mn;
        }
    }
    // merge the warps
    __shared__ float sm_m[WARPS][REP], sm_l[WARPS][REP];
    __shared__ float sm_o[WARPS][REP][D];
    if (grp == 0) {
#pragma unroll
        for (int r = 0; r < REP; ++r) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) sm_o[warp][r][sub * VEC + i] = o[r][i];
            if (sub == 0) { sm_m[warp][r] = m[r]; sm_l[warp][r] = l[r]; }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < REP * D; idx += WARPS * 32) {
        const int r = idx / D, d = idx % D;
        float M = -1e30f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_m[w][r]);
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = exp2f(sm_m[w][r] - M);
            L += sm_l[w][r] * f;
            O += sm_o[w][r][d] * f;
        }
        const long qh = (long)row * HKV * REP + h * REP + r;  // (row, query head)
"""

_CUDA_ONE_PASS = """
        out[qh * D + d] = static_cast<T>(L > 0.f ? O / L : 0.f);
    }
"""

_CUDA_SPLIT = """
        const long p = qh * splits + split;
        part_o[p * D + d] = O;
        if (d == 0) { part_m[p] = M; part_l[p] = L; }
    }
"""

# The fused variant: each row's newest key and value (xk, xv [rows, kv_heads, 1, dim], read through their
# strides) are stored at the row's slot (`slots` [rows]) by the threadblock of split 0, and attended by its
# warp 0 from registers, so no thread reads them back from the store: a layer of a decode pass is then one
# launch, with no separate write kernel and no flag ordering the two. The store's other threadblocks may load
# that slot while it is written, but only as a masked key past `len`: never scored, never accumulated.
_CUDA_STORE_NEWEST = """
    if (split == 0) {
        const long dst = ((long)h * nb_store * BS + slots[row]) * D;
        const T* kn = xk + row * xk_strides[0] + h * xk_strides[1];
        const T* vn = xv + row * xv_strides[0] + h * xv_strides[1];
        for (int i = threadIdx.x; i < D; i += WARPS * 32) {
            const_cast<T*>(k)[dst + i] = kn[i];
            const_cast<T*>(v)[dst + i] = vn[i];
        }
    }
"""

_CUDA_NEWEST_KEY = """
    if (warp == 0 && split == 0) {
        const Vec kn = *reinterpret_cast<const Vec*>(xk + row * xk_strides[0] + h * xk_strides[1] + sub * VEC);
        const Vec vn = *reinterpret_cast<const Vec*>(xv + row * xv_strides[0] + h * xv_strides[1] + sub * VEC);
#pragma unroll
        for (int r = 0; r < REP; ++r) {
            float d = 0.f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) d += qf[r][i] * static_cast<float>(kn[i]);
#pragma unroll
            for (int x = G / 2; x > 0; x >>= 1) d += __shfl_xor_sync(0xffffffff, d, x);
            if (grp == 0) {  // one lane group takes it: the merges below add the groups up
                const float mn = fmaxf(m[r], d);
                const float f = exp2f(m[r] - mn), p = exp2f(d - mn);
                m[r] = mn;
                l[r] = l[r] * f + p;
#pragma unroll
                for (int i = 0; i < VEC; ++i) o[r][i] = o[r][i] * f + p * static_cast<float>(vn[i]);
            }
        }
    }
"""


def _cuda_source(tail: str, fused: bool) -> str:
    """The walk with its ending (`tail`: one pass's output or a split's partials); `fused`: the variant
    that stores and attends each row's newest key itself (queries read through their strides)."""
    if fused:
        walk = (_CUDA_WALK.replace("STORE_NEWEST", _CUDA_STORE_NEWEST).replace("NEWEST_KEY", _CUDA_NEWEST_KEY)
                .replace("Q_AT(row, h * REP + r)", "row * q_strides[0] + (long)(h * REP + r) * q_strides[1]"))
        return "    constexpr int NEW = 1;\n" + walk + tail
    walk = (_CUDA_WALK.replace("STORE_NEWEST", "").replace("NEWEST_KEY", "")
            .replace("Q_AT(row, h * REP + r)", "((long)(row * HKV + h) * REP + r) * D"))
    return "    constexpr int NEW = 0;\n" + walk + tail

_CUDA_MERGE = """
    const int d = threadIdx.x;
    const long qh = blockIdx.y;
    const int splits = part_m_shape[2];
    float M = -1e30f;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, part_m[qh * splits + s]);
    float L = 0.f, O = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float f = exp2f(part_m[qh * splits + s] - M);
        L += part_l[qh * splits + s] * f;
        O += part_o[(qh * splits + s) * D + d] * f;
    }
    out[qh * D + d] = static_cast<T>(L > 0.f ? O / L : 0.f);
"""

_METAL = """
    constexpr int G = D / VEC;
    constexpr int KPW = 32 / G;
    const uint lane = thread_index_in_simdgroup;
    const uint warp = simdgroup_index_in_threadgroup;
    const uint tid = thread_position_in_threadgroup.x;
    const int grp = lane / G;
    const int sub = lane % G;
    const int row = threadgroup_position_in_grid.y / HKV;
    const int h = threadgroup_position_in_grid.y % HKV;
    const int len = lengths[row];
    const int maxb = tables_shape[1];
    const long nb_store = k_shape[1] / SLOTS;
    const int nblk = metal::min((len + BS - 1) / BS, maxb);
    const float sc = scale[0];
    float qf[REP][VEC];
    float m[REP], l[REP], o[REP][VEC];
    for (int r = 0; r < REP; ++r) {
        for (int i = 0; i < VEC; ++i) {
            qf[r][i] = float(q[((long)(row * HKV + h) * REP + r) * D + sub * VEC + i]) * sc;
            o[r][i] = 0.0f;
        }
        m[r] = -1e30f;
        l[r] = 0.0f;
    }
    for (int b = warp; b < nblk; b += WARPS) {
        const long base = ((long)h * nb_store + tables[(long)row * maxb + b]) * (BS * D) + sub * VEC;
        for (int t = grp; t < BS; t += KPW) {
            const bool valid = b * BS + t < len;
            float s[REP];
            for (int r = 0; r < REP; ++r) {
                float d = 0.0f;
                for (int i = 0; i < VEC; ++i) d += qf[r][i] * float(k[base + (long)t * D + i]);
                for (ushort x = G / 2; x > 0; x >>= 1) d += metal::simd_shuffle_xor(d, x);
                s[r] = d;
            }
            if (valid) {
                for (int r = 0; r < REP; ++r) {
                    const float mn = metal::max(m[r], s[r]);
                    const float f = metal::exp2(m[r] - mn), p = metal::exp2(s[r] - mn);
                    m[r] = mn;
                    l[r] = l[r] * f + p;
                    for (int i = 0; i < VEC; ++i) o[r][i] = o[r][i] * f + p * float(v[base + (long)t * D + i]);
                }
            }
        }
    }
    for (ushort x = G; x < 32; x <<= 1) {
        for (int r = 0; r < REP; ++r) {
            const float mo = metal::simd_shuffle_xor(m[r], x), lo = metal::simd_shuffle_xor(l[r], x);
            const float mn = metal::max(m[r], mo);
            const float fa = metal::exp2(m[r] - mn), fb = metal::exp2(mo - mn);
            l[r] = l[r] * fa + lo * fb;
            for (int i = 0; i < VEC; ++i) o[r][i] = o[r][i] * fa + metal::simd_shuffle_xor(o[r][i], x) * fb;
            m[r] = mn;
        }
    }
    threadgroup float sm_m[WARPS][REP];
    threadgroup float sm_l[WARPS][REP];
    threadgroup float sm_o[WARPS][REP][D];
    if (grp == 0) {
        for (int r = 0; r < REP; ++r) {
            for (int i = 0; i < VEC; ++i) sm_o[warp][r][sub * VEC + i] = o[r][i];
            if (sub == 0) { sm_m[warp][r] = m[r]; sm_l[warp][r] = l[r]; }
        }
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    for (uint idx = tid; idx < REP * D; idx += WARPS * 32) {
        const int r = idx / D, d = idx % D;
        float M = -1e30f;
        for (int w = 0; w < WARPS; ++w) M = metal::max(M, sm_m[w][r]);
        float L = 0.0f, O = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            const float f = metal::exp2(sm_m[w][r] - M);
            L += sm_l[w][r] * f;
            O += sm_o[w][r][d] * f;
        }
        out[((long)row * HKV * REP + h * REP + r) * D + d] = T(L > 0.0f ? O / L : 0.0f);
    }
"""

_INPUTS = ["q", "k", "v", "tables", "lengths", "scale"]
# the CUDA kernels also take the flag of this pass's in-place K/V write (cuda_write): unread, it gives MLX's
# CUDA graph the edge write -> read, which it draws only from arrays a kernel declares
_CUDA_INPUTS = _INPUTS + ["written"]
# the fused kernels take the newest keys and values and their slots instead (_CUDA_STORE_NEWEST)
_CUDA_FUSED_INPUTS = _INPUTS + ["xk", "xv", "slots"]

# New tokens' K and V [heads, N, width] stored at their slots of a layer's stores [heads, slots, width]
# through their pointers, K and V in one launch (K's elements first, then V's: their widths may differ): MLX
# never sees a store change, so it never copies a store that the pass in flight still reads (docs/engine.md,
# "Writing the block store in place on CUDA"); `done` orders the pass's reads.
_CUDA_WRITE = """
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long N = xk_shape[1];
    const long WK = xk_shape[2], WV = xv_shape[2];
    const long nk = (long)xk_shape[0] * N * WK;
    if (i < nk) {
        const long w = i % WK, n = (i / WK) % N, h = i / (WK * N);
        const_cast<T*>(k_store)[(h * (long)k_store_shape[1] + slots[n]) * WK + w] = xk[i];
    } else if (i < nk + (long)xv_shape[0] * N * WV) {
        const long j = i - nk;
        const long w = j % WV, n = (j / WV) % N, h = j / (WV * N);
        const_cast<T*>(v_store)[(h * (long)v_store_shape[1] + slots[n]) * WV + w] = xv[j];
    }
    if (i == 0) done[0] = 1;
"""

# A layer's K and V [rows, heads, span, width] through the slots [rows, span] after the pass's in-place
# write (`after`: its flag, for the graph's edge), both in one launch: what a model that reads the fetched
# K/V gets in such a pass.
_CUDA_GATHER = """
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long S = slots_shape[1];
    const long WK = k_store_shape[2], WV = v_store_shape[2];
    const long HK = k_store_shape[0], HV = v_store_shape[0];
    const long nk = (long)slots_shape[0] * HK * S * WK;
    if (i < nk) {
        const long w = i % WK, t = (i / WK) % S, h = (i / (WK * S)) % HK, r = i / (WK * S * HK);
        k_out[i] = k_store[(h * (long)k_store_shape[1] + slots[r * S + t]) * WK + w];
    } else if (i < nk + (long)slots_shape[0] * HV * S * WV) {
        const long j = i - nk;
        const long w = j % WV, t = (j / WV) % S, h = (j / (WV * S)) % HV, r = j / (WV * S * HV);
        v_out[j] = v_store[(h * (long)v_store_shape[1] + slots[r * S + t]) * WV + w];
    }
"""


@lru_cache(maxsize=None)
def _cuda_kernels(fused: bool = False) -> tuple[Any, Any, Any]:
    """(one pass, split, merge); `fused`: the variant that stores each row's newest K/V itself, which
    writes the store through its pointer, so MLX must never hand it a copy (ensure_row_contiguous off:
    the stores and tables are contiguous by construction, the queries and newest K/V are read through
    their strides)."""
    names = _CUDA_FUSED_INPUTS if fused else _CUDA_INPUTS
    tag = "_new" if fused else ""
    one = mx.fast.cuda_kernel(name="paged_decode" + tag, input_names=names, output_names=["out"],
                              source=_cuda_source(_CUDA_ONE_PASS, fused), ensure_row_contiguous=not fused)
    split = mx.fast.cuda_kernel(name="paged_decode_split" + tag, input_names=names,
                                output_names=["part_o", "part_m", "part_l"], source=_cuda_source(_CUDA_SPLIT, fused),
                                ensure_row_contiguous=not fused)
    merge = mx.fast.cuda_kernel(name="paged_decode_merge", input_names=["part_o", "part_m", "part_l"],
                                output_names=["out"], source=_CUDA_MERGE)
    return one, split, merge


@lru_cache(maxsize=None)
def _metal_kernel() -> Any:
    return mx.fast.metal_kernel(name="paged_decode", input_names=_INPUTS, output_names=["out"], source=_METAL)


def kernel_fits(queries: mx.array, k_store: mx.array) -> bool:
    """Whether the kernels take this shape and dtype: a head dim of whole 16-byte loads with at
    most 32 of them, block size a multiple of the keys a warp loads at once."""
    dim, block_size = queries.shape[-1], k_store.shape[2]
    if queries.dtype not in (mx.float32, mx.float16, mx.bfloat16) or k_store.dtype != queries.dtype:
        return False
    vec = 16 // queries.dtype.size
    lanes = dim // vec
    return (dim % vec == 0 and 0 < lanes <= 32 and 32 % lanes == 0 and block_size % (32 // lanes) == 0
            and queries.shape[1] % k_store.shape[0] == 0)


def auto_splits(rows: int, kv_heads: int, table_width: int) -> int:
    """Splits of each row's blocks so a pass has about TARGET_BLOCKS threadblocks, each split
    taking at least SPLIT_BLOCKS blocks. On the H200 a decode pass of one row up to 2,048 keys is
    bound by launches, not by reading: one kernel (no split, no merge) was fastest there
    (perf/results/paged-attention-h200.md)."""
    want = math.ceil(TARGET_BLOCKS / max(1, rows * kv_heads))
    return max(1, min(want, table_width // SPLIT_BLOCKS))


@lru_cache(maxsize=64)
def _scale(scale: float) -> mx.array:
    """The kernels' score scale (times log2 e: they exponentiate with exp2), made once per value:
    an array made per call is one more op per layer, which a one-row pass pays in full."""
    return mx.array([scale * LOG2E], dtype=mx.float32)


def _template(queries: mx.array, k_store: mx.array, block_size: int | None = None) -> list[tuple[str, Any]]:
    """The kernels' constants; a store [kv_heads, slots, dim] (the live store itself: no reshape op in the
    graph, which a one-row pass pays per layer) takes its `block_size`, tiles [kv_heads, blocks, block_size,
    dim] carry it."""
    if k_store.ndim == 3:
        if block_size is None:
            raise ValueError("a store of slots [kv_heads, slots, dim] needs its block_size")
        kv_heads, _, dim = k_store.shape
        slots = block_size
    else:
        kv_heads, _, block_size, dim = k_store.shape
        slots = 1
    return [("T", queries.dtype), ("D", dim), ("REP", queries.shape[1] // kv_heads), ("HKV", kv_heads),
            ("BS", block_size), ("WARPS", WARPS), ("SLOTS", slots)]


@lru_cache(maxsize=None)
def _write_kernels() -> tuple[Any, Any]:
    # the store is never made row-contiguous by MLX (a copy would take the writes); the callers pass
    # contiguous new K/V and slots
    write = mx.fast.cuda_kernel(name="paged_kv_write", input_names=["k_store", "v_store", "xk", "xv", "slots"],
                                output_names=["done"], source=_CUDA_WRITE, ensure_row_contiguous=False)
    gather = mx.fast.cuda_kernel(name="paged_kv_gather_after", input_names=["k_store", "v_store", "slots", "after"],
                                 output_names=["k_out", "v_out"], source=_CUDA_GATHER, ensure_row_contiguous=False)
    return write, gather


@lru_cache(maxsize=None)
def _not_written() -> mx.array:
    """The write flag a pass without in-place writes gives the CUDA kernels."""
    flag = mx.zeros((1,), dtype=mx.int32)
    mx.eval(flag)
    return flag


_THREADS = 256


def _grid(total: int) -> tuple[int, int, int]:
    return (-(-total // _THREADS) * _THREADS, 1, 1)


def cuda_write(k_store: mx.array, v_store: mx.array, k_new: mx.array, v_new: mx.array, slots: mx.array) -> mx.array:
    """Store `k_new` and `v_new` [heads, N, width] at `slots` [N] of `k_store` and `v_store` [heads, slots,
    width] in place, in one launch (each custom kernel a layer costs the host its own source build and
    launch: a one-row pass is bound by them); returns the write's flag, which every read of the stores in
    the same pass must take as an input."""
    write, _ = _write_kernels()
    n = slots.shape[0] if slots.ndim == 1 else -1
    for store, new in ((k_store, k_new), (v_store, v_new)):
        if store.ndim != 3 or new.ndim != 3 or store.shape[0] != new.shape[0] or store.shape[2] != new.shape[2] \
                or new.shape[1] != n or store.dtype != k_store.dtype:
            raise ValueError(f"an in-place write takes new [heads, N, width] into a store [heads, slots, width] at "
                             f"slots [N], K's and V's stores of one dtype; got {new.shape}, {store.shape}, "
                             f"{slots.shape}")
    xk = mx.contiguous(k_new.astype(k_store.dtype))
    xv = mx.contiguous(v_new.astype(v_store.dtype))
    return write(inputs=[k_store, v_store, xk, xv, mx.contiguous(slots.astype(mx.int32))],
                 template=[("T", k_store.dtype)], grid=_grid(xk.size + xv.size), threadgroup=(_THREADS, 1, 1),
                 output_shapes=[(1,)], output_dtypes=[mx.int32])[0]


def cuda_gather_after(k_store: mx.array, v_store: mx.array, slots: mx.array,
                      after: mx.array) -> tuple[mx.array, mx.array]:
    """K and V [rows, heads, span, width]: the stores [heads, slots, width] at `slots` [rows, span], read
    after the in-place write whose flag is `after` (one launch, if anything reads them)."""
    _, gather = _write_kernels()
    rows, span = slots.shape
    shapes = [(rows, store.shape[0], span, store.shape[2]) for store in (k_store, v_store)]
    k_out, v_out = gather(inputs=[k_store, v_store, mx.contiguous(slots.astype(mx.int32)), after],
                          template=[("T", k_store.dtype)],
                          grid=_grid(sum(math.prod(shape) for shape in shapes)), threadgroup=(_THREADS, 1, 1),
                          output_shapes=shapes, output_dtypes=[k_store.dtype, v_store.dtype])
    return k_out, v_out


def cuda_attention(queries: mx.array, k_store: mx.array, v_store: mx.array, tables: mx.array, lengths: mx.array,
                   scale: float, splits: int | None = None, written: mx.array | None = None,
                   newest: tuple[mx.array, mx.array, mx.array] | None = None,
                   block_size: int | None = None) -> mx.array:
    """Decode attention [rows, heads, 1, dim] through the CUDA kernel (arguments as
    paged_attention.paged_decode_attention; `splits`: None = auto_splits; `written`: the flag of this
    pass's in-place write of the layer's K and V, cuda_write). `newest`: (keys, values [rows, kv_heads, 1,
    dim], slots [rows]) of each row's newest token, which `lengths` count but the stores do not hold yet:
    the kernel stores them at their slots and attends them in the same launch (the fused variant); the
    output then orders any later read of the stores in the pass (cuda_gather_after's `after`). The stores
    may be tiles [kv_heads, blocks, block_size, dim] or the live stores [kv_heads, slots, dim] themselves
    with their `block_size`."""
    rows, heads, _, dim = queries.shape
    kv_heads = k_store.shape[0]
    splits = auto_splits(rows, kv_heads, tables.shape[1]) if splits is None else splits
    if newest is not None:
        if written is not None:
            raise ValueError("a pass either stores each row's newest K/V in the attention kernel or before it")
        xk, xv, slots = newest
        want = (rows, kv_heads, 1, dim)
        if xk.shape != want or xv.shape != want or slots.shape != (rows,) or xk.dtype != k_store.dtype \
                or xv.dtype != v_store.dtype or slots.dtype != mx.int32:
            raise ValueError(f"the fused kernel takes the newest keys and values [rows, kv_heads, 1, dim] = {want} in "
                             f"the stores' dtype and int32 slots [rows]; got {xk.shape} {xk.dtype}, {xv.shape} "
                             f"{xv.dtype}, {slots.shape} {slots.dtype}")
        one, split, merge = _cuda_kernels(True)
        inputs = [queries, k_store, v_store, tables, lengths, _scale(scale), xk, xv, slots]
    else:
        one, split, merge = _cuda_kernels()
        inputs = [queries, k_store, v_store, tables, lengths, _scale(scale),
                  written if written is not None else _not_written()]
    if v_store.shape != k_store.shape or (k_store.ndim == 3 and (block_size is None or k_store.shape[1] % block_size)):
        raise ValueError(f"the CUDA kernel takes K and V stores of one shape, [kv_heads, blocks, block_size, dim] or "
                         f"[kv_heads, slots, dim] with slots a multiple of block_size; got {k_store.shape}, "
                         f"{v_store.shape}, block_size {block_size}")
    template = _template(queries, k_store, block_size)
    threads = (WARPS * 32, 1, 1)
    if splits == 1:
        return one(inputs=inputs, template=template, grid=(WARPS * 32, rows * kv_heads, 1), threadgroup=threads,
                   output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]
    part_o, part_m, part_l = split(inputs=inputs, template=template, grid=(WARPS * 32, rows * kv_heads, splits),
                                   threadgroup=threads,
                                   output_shapes=[(rows, heads, splits, dim), (rows, heads, splits),
                                                  (rows, heads, splits)],
                                   output_dtypes=[mx.float32] * 3)
    return merge(inputs=[part_o, part_m, part_l], template=[("T", queries.dtype), ("D", dim)],
                 grid=(dim, rows * heads, 1), threadgroup=(dim, 1, 1), output_shapes=[queries.shape],
                 output_dtypes=[queries.dtype])[0]


def metal_attention(queries: mx.array, k_store: mx.array, v_store: mx.array, tables: mx.array, lengths: mx.array,
                    scale: float) -> mx.array:
    """Decode attention [rows, heads, 1, dim] through the Metal kernel (Apple silicon only)."""
    rows = queries.shape[0]
    template = _template(queries, k_store) + [("VEC", 16 // queries.dtype.size)]
    return _metal_kernel()(inputs=[queries, k_store, v_store, tables, lengths, _scale(scale)],
                           template=template, grid=(WARPS * 32, rows * k_store.shape[0], 1),
                           threadgroup=(WARPS * 32, 1, 1), output_shapes=[queries.shape],
                           output_dtypes=[queries.dtype])[0]
