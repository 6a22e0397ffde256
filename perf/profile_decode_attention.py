"""What a multi-row decode pass's attention costs with the engine's per-row mask, against the same
attention without a mask, on the live KV's layout (a slice of a [rows, kv_heads, capacity, dim]
buffer), for one model's layers.

Rows of a decode batch sit at different lengths, so the engine hands `mx.fast.scaled_dot_product_attention`
a boolean mask [rows, 1, 1, T] hiding each row's unused tail. On MLX's CUDA backend (main at 846d176,
mlx/backend/cuda/scaled_dot_product_attention.cu) the fused vector kernel takes no array mask
(`supports_sdpa_vector` is false with one) and cuDNN is used for a one-token query only without one,
so a masked decode runs MLX's composed fallback (scale, matmul against K broadcast over the query
heads of each KV head, `where`, softmax, batched matmul against V) in every layer; an unmasked one
(every row at the same length, e.g. one stream) runs the fused kernel. Metal's vector kernel reads
bool masks, so this is a CUDA question. Per rows × span, the median of `--repeats` passes over
`--layers` layers (each layer its own K/V buffer, evaluated once per pass):

- `masked`: the engine's decode attention (fused entry point, bool mask: the fallback on CUDA);
- `unmasked`: the same without a mask (the fused vector kernel on CUDA; wrong for rows of unequal
  length, here only as the floor);
- `unfused`: parallm.engine.fastmath.unfused_sdpa with the mask (the query heads of a KV head as
  the rows of one matmul, a float32 softmax; no broadcast of K or V).

On the CPU all three are composed ops (MLX's CPU backend has no fused attention).

    python -m perf.profile_decode_attention --rows 1,16,64,256 --spans 256,1024   # -> decode-attention-<device>.*
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from perf.harness import Results, add_results_options, describe


def one_pass(way: str, q: mx.array, keys: list[mx.array], values: list[mx.array], mask: mx.array | None,
             scale: float) -> list[mx.array]:
    from parallm.engine.fastmath import unfused_sdpa

    outs = []
    for k, v in zip(keys, values):
        if way == "masked":
            outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
        elif way == "unmasked":
            outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))
        else:
            outs.append(unfused_sdpa(q, k, v, scale, mask))
    return outs


def measure(rows: int, span: int, args: argparse.Namespace) -> dict:
    dtype = getattr(mx, args.dtype)
    capacity = span + 64  # the live buffer is longer than the longest row, as the engine's is
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    mx.random.seed(0)
    k_bufs = [mx.random.normal((rows, Hkv, capacity, D)).astype(dtype) for _ in range(args.layers)]
    v_bufs = [mx.random.normal((rows, Hkv, capacity, D)).astype(dtype) for _ in range(args.layers)]
    q = mx.random.normal((rows, H, 1, D)).astype(dtype)
    lengths = mx.array([span - (i * 37) % max(1, span // 2) for i in range(rows)])  # the longest is `span`
    mask = (mx.arange(span)[None] < lengths[:, None])[:, None, None, :]
    mx.eval(k_bufs, v_bufs, q, mask)
    keys = [k[:, :, :span] for k in k_bufs]
    values = [v[:, :, :span] for v in v_bufs]
    scale = D ** -0.5
    row = {"rows": rows, "span": span}
    for way in ("masked", "unmasked", "unfused"):
        for _ in range(2):
            mx.eval(one_pass(way, q, keys, values, mask, scale))
        times = []
        for _ in range(args.repeats):
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(one_pass(way, q, keys, values, mask, scale))
            mx.synchronize()
            times.append(1000 * (time.perf_counter() - t0))
        row[f"{way}_ms"] = round(statistics.median(times), 3)
    masked, unfused = (one_pass(way, q, keys[:1], values[:1], mask, scale)[0] for way in ("masked", "unfused"))
    row["unfused_max_abs_diff"] = float(mx.max(mx.abs(masked.astype(mx.float32) - unfused.astype(mx.float32))))
    kv_bytes = 2 * args.layers * rows * Hkv * span * D * mx.zeros((), dtype=dtype).itemsize
    row["kv_gb_read"] = round(kv_bytes / 1e9, 3)
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--spans", default="256,1024")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("decode-attention", args, argv)
    rows = [measure(r, s, args) for s in (int(x) for x in args.spans.split(","))
            for r in (int(x) for x in args.rows.split(","))]
    table = ["| rows | span | KV read (GB) | masked ms | unmasked ms | unfused ms | unfused vs masked, max abs diff |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['rows']} | {r['span']} | {r['kv_gb_read']} | {r['masked_ms']} | {r['unmasked_ms']} | "
              f"{r['unfused_ms']} | {r['unfused_max_abs_diff']:.2g} |" for r in rows]
    md = [f"# Decode attention over {args.layers} layers ({args.heads} heads, {args.kv_heads} KV heads, dim "
          f"{args.head_dim}, {args.dtype}): the engine's masked call vs unmasked vs unfused", "",
          f"Machine: {describe(results.machine)}", "", f"Command: `{results.command}`", "", *table]
    results.write({"rows": rows, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                   "head_dim": args.head_dim, "dtype": args.dtype}, "\n".join(md))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
