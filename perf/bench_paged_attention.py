"""Decode attention read from today's dense rows vs through block tables (issue 41, item 1's read
path): per rows x context x length mix, the median time of one layer's attention, on whatever
device MLX computes on.

- `dense`: the dense rows [rows, kv_heads, capacity, dim] sliced to the longest row, called as the
  engine does: every row at the same length (`uniform`) has no mask (the engine's unmasked fast
  path); rows at mixed lengths (`ragged`) get the boolean mask [rows, 1, 1, T]; on the CPU in
  float32 through fastmath's attention (FastMath is entered around the engine's passes), on CUDA
  through fastmath.unfused_sdpa when masked (engine.unfused_decode, CUDA's default since issue
  37) and MLX's fused kernel when not;
- `dense_fused`: MLX's own mx.fast.scaled_dot_product_attention with the same mask (GPU only: on
  the CPU it is the composed fallback, slower than `dense`);
- `gather`: parallm.engine.paged_attention's reference read of a head-major block store
  [kv_heads, blocks, 16, dim] whose blocks are handed out shuffled (as a churned store's are): the
  rows' blocks copied out, then matmuls;
- `gather_mm`: the same store read in place by mx.gather_mm (float32 only on the CPU);
- `kernel`: the backend's paged kernel (CUDA or Metal; not on the CPU), split-K chosen by
  paged_kernels.auto_splits.

Shape: Llama-3.2-3B's attention (24 query heads, 8 KV heads, head dim 128). One pass evaluates
`--calls` layer calls (on a GPU 28, a model step's worth; on the CPU one per distinct layer)
cycling through `--layers` distinct layers, each with its own buffers (as many as it takes to read
256 MiB of KV, at most 28, so a GPU's L2 cache does not hold them across calls); times are per
layer call (a pass / its calls); a 28-layer step's attention is 28x that. Ways alternate within
each repeat. `uniform` rows all hold the context; `ragged` ones hold context - (37 i mod context/2) keys (the longest
holds the context; one row is always uniform, so rows=1 is measured uniform only). What the engine
makes once per pass for all layers is made before timing: the dense mask, the block tables (one set
shared by every layer's store) and their PagedRead. The writes of the new tokens (one scatter per
layer either way) are not timed.

    python -m perf.bench_paged_attention --rows 1,16,64 --contexts 512,2048 --repeats 7   # CPU, float32
    python -m perf.bench_paged_attention --rows 1,64,256 --contexts 512,2048 --repeats 20  # GPU, bfloat16
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from parallm.engine.paged_attention import PagedRead
from perf.harness import Results, add_results_options, describe

BLOCK = 16
L2_DEFEAT_BYTES = 256 << 20  # KV bytes a pass reads at least (distinct layers) before repeating one


def lengths_for(rows: int, context: int, mix: str) -> list[int]:
    if mix == "uniform":
        return [context] * rows
    return [context - (i * 37) % max(1, context // 2) for i in range(rows)]


def build_layer(rows: int, context: int, tab: mx.array, n_blocks: int, args: argparse.Namespace,
                dtype: mx.Dtype) -> dict:
    """One layer's dense buffers and block store holding the same K/V (the block tables `tab` are the
    pass's, shared by every layer as the engine's are)."""
    H, D = args.kv_heads, args.head_dim
    width = tab.shape[1]
    capacity = context + 64  # the dense buffer is longer than its longest row, as the engine's is
    k_dense = mx.random.normal((rows, H, capacity, D)).astype(dtype)
    v_dense = mx.random.normal((rows, H, capacity, D)).astype(dtype)
    # the store: block tab[r, j] of head h holds the dense row r's positions [16 j, 16 j + 16)
    k_store = mx.zeros((H, n_blocks, BLOCK, D), dtype=dtype)
    v_store = mx.zeros((H, n_blocks, BLOCK, D), dtype=dtype)
    k_blocks = k_dense[:, :, : width * BLOCK].reshape(rows, H, width, BLOCK, D).transpose(1, 0, 2, 3, 4)
    v_blocks = v_dense[:, :, : width * BLOCK].reshape(rows, H, width, BLOCK, D).transpose(1, 0, 2, 3, 4)
    k_store[:, tab.reshape(-1)] = k_blocks.reshape(H, rows * width, BLOCK, D)
    v_store[:, tab.reshape(-1)] = v_blocks.reshape(H, rows * width, BLOCK, D)
    mx.eval(k_dense, v_dense, k_store, v_store)
    return {"k_dense": k_dense, "v_dense": v_dense, "k_store": k_store, "v_store": v_store}


def ways_for(device: str, dtype: mx.Dtype) -> list[str]:
    if device == "cpu":
        return ["dense", "gather", "gather_mm"] if dtype == mx.float32 else ["dense", "gather"]
    return ["dense", "dense_fused", "gather", "gather_mm", "kernel"]


def attend(way: str, layer: dict, q: mx.array, read: PagedRead, mask: mx.array | None, context: int,
           scale: float, device: str) -> mx.array:
    from parallm.engine import fastmath, paged_attention, paged_kernels

    if way in ("dense", "dense_fused"):
        k, v = layer["k_dense"][:, :, :context], layer["v_dense"][:, :, :context]
        if way == "dense_fused":
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        if device == "cpu" and q.dtype == mx.float32:
            return fastmath.scaled_dot_product_attention(q, k, v, None, scale, mask)
        if device == "cuda" and mask is not None:
            return fastmath.unfused_sdpa(q, k, v, scale, mask)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    if way == "gather":
        return paged_attention.gather_attention(q, layer["k_store"], layer["v_store"], read, scale)
    if way == "gather_mm":
        return paged_attention.gather_mm_attention(q, layer["k_store"], layer["v_store"], read, scale)
    if device == "cuda":
        return paged_kernels.cuda_attention(q, layer["k_store"], layer["v_store"], read.tables, read.lengths, scale)
    return paged_kernels.metal_attention(q, layer["k_store"], layer["v_store"], read.tables, read.lengths, scale)


def measure(rows: int, context: int, mix: str, args: argparse.Namespace, device: str) -> dict:
    dtype = getattr(mx, args.dtype)
    rng = np.random.default_rng(0)
    mx.random.seed(0)
    lens = lengths_for(rows, context, mix)
    per_layer = 2 * rows * args.kv_heads * context * args.head_dim * dtype.size
    n_layers = args.layers or min(28, max(1, math.ceil(L2_DEFEAT_BYTES / per_layer)))
    width = -(-context // BLOCK)
    n_blocks = rows * width + 16
    tab = mx.array(rng.permutation(n_blocks)[: rows * width].reshape(rows, width).astype(np.int32))
    layers = [build_layer(rows, context, tab, n_blocks, args, dtype) for _ in range(n_layers)]
    q = mx.random.normal((rows, args.heads, 1, args.head_dim)).astype(dtype)
    lengths = mx.array(lens, dtype=mx.int32)
    # made once per pass, as the engine's mask is: no mask when every row is at the same length (always so
    # for one row); the block tables' derived indices likewise
    mask = None if len(set(lens)) == 1 else (mx.arange(context)[None] < lengths[:, None])[:, None, None, :]
    read = PagedRead(tab, lengths)
    mx.eval(q, lengths, read.visible(BLOCK), read.tiles(args.kv_heads, n_blocks), *([mask] if mask is not None else []))
    scale = args.head_dim ** -0.5
    ways = [w for w in ways_for(device, dtype) if not args.ways or w in args.ways.split(",")]

    calls = max(n_layers, args.calls if args.calls >= 0 else (0 if device == "cpu" else 28))

    def one_pass(way: str) -> Callable[[], None]:
        return lambda: mx.eval([attend(way, layers[i % n_layers], q, read, mask, context, scale, device)
                                for i in range(calls)])

    passes = {w: one_pass(w) for w in ways}
    failed = {}
    for w in list(ways):  # warm-up: kernels compiled, buffers allocated; a way that fails is reported, not timed
        try:
            for _ in range(2):
                passes[w]()
        except Exception as e:  # noqa: BLE001 - e.g. a kernel that does not compile on this device
            failed[w] = f"{type(e).__name__}: {e}"[:2000]
            ways.remove(w)
    times: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.repeats):
        for w in ways:
            mx.synchronize()
            t0 = time.perf_counter()
            passes[w]()
            mx.synchronize()
            times[w].append(1000 * (time.perf_counter() - t0) / calls)
    ref = attend("dense", layers[0], q, read, mask, context, scale, device).astype(mx.float32)
    row = {"rows": rows, "context": context, "lengths": mix, "layers": n_layers, "calls": calls, "repeats": args.repeats,
           "kv_mb_per_layer": round(per_layer / 2**20, 2), **({"failed": failed} if failed else {})}
    for w in ways:
        row[f"{w}_ms"] = round(statistics.median(times[w]), 4)
        row[f"{w}_min_ms"] = round(min(times[w]), 4)
        out = attend(w, layers[0], q, read, mask, context, scale, device).astype(mx.float32)
        row[f"{w}_max_abs_diff"] = float(mx.max(mx.abs(out - ref)))
    for w in ways[1:]:  # > 1: faster than dense
        row[f"{w}_vs_dense"] = round(row["dense_ms"] / row[f"{w}_ms"], 3)
        row[f"{w}_vs_dense_min"] = round(row["dense_min_ms"] / row[f"{w}_min_ms"], 3)
    print(row, flush=True)
    del layers
    mx.clear_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--mixes", default="uniform,ragged")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="float32 on the CPU, bfloat16 on a GPU (default)")
    parser.add_argument("--layers", type=int, default=0,
                        help="distinct layers per pass (0: enough to read 256 MiB of KV, at most 28)")
    parser.add_argument("--calls", type=int, default=-1,
                        help="layer calls per timed pass, cycling the distinct layers (-1: one per layer on the CPU, "
                             "28 on a GPU, a model step's worth, so a sync is not timed per layer)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ways", default="", help="only these ways, comma-separated (dense always first; default: "
                                                   "all the device has)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    from parallm import blas

    if not blas.is_preloaded() and blas.openblas_env() is not None:
        blas.reexec_with_openblas()  # as the engine runs: MLX's Linux CPU wheel links a reference BLAS
    device = "cpu" if mx.default_device() != mx.gpu else ("metal" if mx.metal.is_available() else "cuda")
    args.dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    results = Results.from_args("paged-attention", args, argv)
    rows = [measure(r, c, m, args, device) for m in args.mixes.split(",") for c in (int(x) for x in args.contexts.split(","))
            for r in (int(x) for x in args.rows.split(",")) if not (r == 1 and m == "ragged")]  # one row: uniform
    ways = [w for w in ways_for(device, getattr(mx, args.dtype)) if not args.ways or w in args.ways.split(",")]
    head = "| lengths | context | rows | " + " | ".join(f"{w} ms" for w in ways) + " | " + \
        " | ".join(f"{w} vs dense (min)" for w in ways[1:]) + " |"
    table = [head, "|" + "---|" * (3 + 2 * len(ways) - 1)]
    table += ["| " + " | ".join([r["lengths"], str(r["context"]), str(r["rows"])]
                                + [f"{r[f'{w}_ms']:.3f}" if f"{w}_ms" in r else "failed" for w in ways]
                                + [f"{r[f'{w}_vs_dense']:.2f}x ({r[f'{w}_vs_dense_min']:.2f}x)"
                                   if f"{w}_ms" in r else "-" for w in ways[1:]])
              + " |" for r in rows]
    md = [f"# Paged decode attention vs the dense rows, one layer ({args.heads} heads, {args.kv_heads} KV heads, "
          f"dim {args.head_dim}, {args.dtype}, block size {BLOCK})", "",
          f"Machine: {describe(results.machine)}", "", f"Command: `{results.command}`", "",
          "ms per layer call (median of the repeats; a pass makes the JSON's `calls` over its `layers` distinct "
          "layers); `vs dense` is "
          "dense ms / the way's ms, > 1 faster than the dense rows, from the medians (from the fastest repeats: "
          "on a shared CPU the least disturbed).", "", *table]
    results.write({"rows": rows, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "dtype": args.dtype, "block_size": BLOCK, "device": device}, "\n".join(md))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
