"""What one custom kernel (mx.fast.cuda_kernel) costs the host in a decode pass, against one built-in op.

A one-row decode pass of a 3B model is bound by the host: the engine builds and launches every layer's
kernels while the device runs the pass before. The block store's pass adds custom kernels per layer (the
in-place K/V write, the paged attention, the gathered K/V if a model reads them), and each custom kernel
builds its source string at every call and hashes it at every evaluation (MLX's CustomKernel). This
measures, on the device MLX computes on:
- build_us: the host time to put one call in the graph (no evaluation): the paged K/V write, the paged
  attention, a built-in `mx.take` of the same size;
- eval_us: one evaluation of a chain of `--layers` x (write, attention) custom kernels, per kernel, against
  a chain of the same number of built-in ops (take + add) of the same sizes; and per layer, that chain
  against one of the fused kernel (cuda_attention's `newest`: the write inside the attention launch).

    python -m perf.diag_kernel_launch --out perf/results/kernel-launch-cost-h200.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from parallm.engine import paged_kernels

from .harness import command, machine, per_call_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("the custom kernels measured here are CUDA's (mx.fast.cuda_kernel)")
    kv_heads, heads, dim, bs, blocks, rows = 8, 24, 128, 16, 64, 1
    dtype = mx.bfloat16
    k = mx.zeros((kv_heads, blocks * bs, dim), dtype=dtype)
    v = mx.zeros((kv_heads, blocks * bs, dim), dtype=dtype)
    kn = mx.random.normal((kv_heads, rows, dim)).astype(dtype)
    vn = mx.random.normal((kv_heads, rows, dim)).astype(dtype)
    slots = mx.array([3 * bs + 5], dtype=mx.int32)
    q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    tables = mx.array([[1, 2, 3, 4]], dtype=mx.int32)
    lengths = mx.array([54], dtype=mx.int32)
    read = mx.arange(64, dtype=mx.int32)[None]
    mx.eval(k, v, kn, vn, slots, q, tables, lengths, read)
    k4, v4 = k.reshape(kv_heads, blocks, bs, dim), v.reshape(kv_heads, blocks, bs, dim)

    def write() -> mx.array:
        return paged_kernels.cuda_write(k, v, kn, vn, slots)

    done = write()
    mx.eval(done)

    def attention() -> mx.array:
        return paged_kernels.cuda_attention(q, k4, v4, tables, lengths, dim ** -0.5, written=done)

    newest = (kn.transpose(1, 0, 2)[:, :, None], vn.transpose(1, 0, 2)[:, :, None], slots)

    def fused() -> mx.array:
        return paged_kernels.cuda_attention(q, k4, v4, tables, lengths, dim ** -0.5, newest=newest)

    def gather() -> tuple[mx.array, mx.array]:
        return paged_kernels.cuda_gather_after(k, v, read, done)

    def builtin() -> mx.array:
        return mx.take(k, read, axis=1)

    build = {name: per_call_us(fn, args.repeats)
             for name, fn in (("write", write), ("attention", attention), ("fused", fused), ("gather_after", gather), ("take", builtin))}

    def custom_chain() -> None:
        x = q
        for _ in range(args.layers):
            flag = paged_kernels.cuda_write(k, v, kn, vn, slots)
            x = paged_kernels.cuda_attention(x, k4, v4, tables, lengths, dim ** -0.5, written=flag)
        mx.eval(x)

    def fused_chain() -> None:
        x = q
        for _ in range(args.layers):
            x = paged_kernels.cuda_attention(x, k4, v4, tables, lengths, dim ** -0.5, newest=newest)
        mx.eval(x)

    def builtin_chain() -> None:
        x = q
        for _ in range(args.layers):
            y = mx.take(k, read, axis=1)
            x = x + y[:1, :1, :1].reshape(1, 1, 1, dim)
        mx.eval(x)

    kernels = 2 * args.layers
    evals = {"custom_per_kernel": per_call_us(custom_chain, 50) / kernels,
             "builtin_per_op": per_call_us(builtin_chain, 50) / kernels,
             "write_and_attention_per_layer": per_call_us(custom_chain, 50) / args.layers,
             "fused_per_layer": per_call_us(fused_chain, 50) / args.layers}
    report = {"command": command(), "machine": machine(), "build_us": build, "eval_us": evals, "layers": args.layers}
    print(json.dumps({"build_us": build, "eval_us": evals}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
