"""The default model's matmuls at 1-8 rows on the CPU (issue 36: what a verify pass of L tokens costs
against a decode step): MLX's `x @ W.T` through the preloaded OpenBLAS, one thread, against the same
weights cut into row blocks small enough for OpenBLAS's small-matrix kernel.

Why. `perf` on a verify pass of the default model shows half its time in OpenBLAS's `sgemm_incopy`
(packing the weights for the blocked kernel) and the rest of the matmul time in `sgemm_kernel`; only
some of a decode step's matmuls take `sgemm_small_kernel_b0_tn`, which reads the weights once,
unpacked. OpenBLAS (0.3.31, SKYLAKEX) takes that kernel for a product of M x N x K <= 1e6 whose
transposed-A output has M x N <= 1200, so which matmuls it takes depends on the shape and on L: at
L = 1 the MLP's down projection (576 x 1536) and the attention projections do, its gate and up
projections (1536 x 576) and the output head do not; at L = 2 the down projection no longer does.
Cut into blocks of rows that satisfy both bounds, every matmul takes it. This is the measurement
behind docs/performance.md ("what a verify pass costs"); nothing in the engine cuts weights.

    python -m perf.bench_small_matmul                   # L = 1, 2, 3, 4, 8; 30 layers' weights each
    python -m perf.bench_small_matmul --lengths 1,2 --repeats 5 --out-dir /tmp/mm   # a smoke run

Results: perf/results/small-matmul-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

from parallm import blas
from perf.harness import Results, add_results_options

# SmolLM2-135M: hidden 576, MLP 1536, 9 query heads and 3 KV heads of 64, 30 layers, vocabulary 49152;
# (out, in) and how many of that shape one pass runs
SHAPES = {"gate+up": ((1536, 576), 60), "down": ((576, 1536), 30), "q+o": ((576, 576), 60),
          "k+v": ((192, 576), 60), "head": ((49152, 576), 1)}
SMALL_MNK, SMALL_MN = 1e6, 1200  # OpenBLAS's small-matrix kernel bounds for a transposed A (SKYLAKEX)


def log(msg: str) -> None:
    print(f"[bench_small_matmul {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1,2,3,4,8", help="rows of x (a pass's tokens)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats per case (median)")
    parser.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS of the preloaded OpenBLAS")
    add_results_options(parser)
    args = parser.parse_args(argv)
    if not blas.is_preloaded():
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    blas.reexec_with_openblas()
    import mlx.core as mx

    files = Results.from_args("small-matmul", args, argv)
    mx.random.seed(0)
    weights = {name: [mx.random.normal(shape) for _ in range(min(n, 30))] for name, (shape, n) in SHAPES.items()}
    mx.eval(weights)
    load_start = os.getloadavg()
    rows: dict[str, Any] = {}
    for L in (int(x) for x in args.lengths.split(",")):
        entry: dict[str, Any] = {}
        for name, (shape, count) in SHAPES.items():
            ws = weights[name]
            n_out, k = shape
            x = mx.random.normal((L, k))
            block = max(1, min(SMALL_MN // L, int(SMALL_MNK // (L * k))))
            blocks = [[mx.contiguous(w[i:i + block]) for i in range(0, n_out, block)] for w in ws]
            mx.eval(x, blocks)
            whole = timed(lambda: mx.eval([x @ w.T for w in ws]), args.repeats)
            cut = timed(lambda: mx.eval([mx.concatenate([x @ b.T for b in bs], axis=1) for bs in blocks]), args.repeats)
            scale = count / len(ws)  # the pass runs `count` of this shape
            entry[name] = {"whole_ms": whole * scale, "blocks_ms": cut * scale, "block_rows": block}
        entry["total_whole_ms"] = sum(e["whole_ms"] for e in entry.values() if isinstance(e, dict))
        entry["total_blocks_ms"] = sum(e["blocks_ms"] for e in entry.values() if isinstance(e, dict) and "blocks_ms" in e)
        rows[str(L)] = entry
        log(f"L={L}: whole {entry['total_whole_ms']:.1f} ms, in blocks {entry['total_blocks_ms']:.1f} ms")
    results = {"lengths": rows, "repeats": args.repeats, "blas_threads": args.blas_threads,
               "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    files.write(results, markdown(results, files.command))
    return 0


def markdown(results: dict[str, Any], command: str) -> str:
    names = list(SHAPES)
    lines = ["# The default model's matmuls at L rows: whole weights vs row blocks for OpenBLAS's small kernel", "",
             f"`{command}`", "",
             "| L | " + " | ".join(f"{n} ms (whole / blocks)" for n in names) + " | all, whole | all, blocks |",
             "|---|" + "---|" * (len(names) + 2)]
    for L, e in results["lengths"].items():
        cells = [f"{e[n]['whole_ms']:.1f} / {e[n]['blocks_ms']:.1f}" for n in names]
        lines.append(f"| {L} | " + " | ".join(cells) + f" | {e['total_whole_ms']:.1f} | {e['total_blocks_ms']:.1f} |")
    lines += ["", "Per pass of the model (30 layers: gate+up and q+o are two matmuls a layer; the head one). "
              f"OpenBLAS threads {results['blas_threads']}. Load average at the start {results['loadavg_start']}, "
              f"at the end {results['loadavg_end']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
