"""The paged decode-attention kernel on this device: equal to the gather (tests/test_paged_attention's
cases, bfloat16 and float32, splits 1, 3 and auto), then ms per layer by split count at a few
Llama-3.2-3B decode shapes (is paged_kernels.auto_splits' choice the fastest?).

    python -m perf.check_paged_kernel --out-dir DIR     # -> DIR/paged-kernel-check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def correctness() -> list[dict]:
    from test_paged_attention import CASES, paged_case

    from parallm.engine import paged_attention, paged_kernels

    out = []
    for lengths, heads, kv_heads, dim in CASES + [([2048, 1], 24, 8, 128), ([4096] * 3 + [17], 32, 8, 128)]:
        for dtype in (mx.float32, mx.bfloat16):
            q, _, _, k_store, v_store, tables, lens = paged_case(lengths, heads, kv_heads, dim, dtype)
            scale = dim ** -0.5
            want = paged_attention.gather_attention(q, k_store, v_store, tables, lens, scale).astype(mx.float32)
            for splits in (1, 3, None):
                try:
                    got = paged_kernels.cuda_attention(q, k_store, v_store, tables, lens, scale, splits=splits)
                    diff = float(mx.max(mx.abs(got.astype(mx.float32) - want)))
                except Exception as e:  # noqa: BLE001
                    diff = f"{type(e).__name__}: {e}"[:3000]
                row = {"lengths": lengths[:4], "heads": heads, "kv_heads": kv_heads, "dim": dim, "dtype": str(dtype),
                       "splits": splits, "max_abs_diff": diff}
                print(row, flush=True)
                out.append(row)
    return out


def splits_sweep() -> list[dict]:
    from perf.bench_paged_attention import BLOCK
    from parallm.engine import paged_kernels

    out = []
    for rows, context in ((1, 512), (1, 2048), (16, 2048), (64, 512), (64, 2048)):
        width = context // BLOCK
        n_blocks = rows * width + 16
        layers = []
        for _ in range(max(1, min(28, (256 << 20) // (2 * rows * 8 * context * 128 * 2)))):
            k = mx.random.normal((8, n_blocks, BLOCK, 128)).astype(mx.bfloat16)
            v = mx.random.normal((8, n_blocks, BLOCK, 128)).astype(mx.bfloat16)
            layers.append((k, v))
        tables = mx.random.permutation(n_blocks)[: rows * width].reshape(rows, width).astype(mx.int32)
        lengths = mx.full((rows,), context, dtype=mx.int32)
        q = mx.random.normal((rows, 24, 1, 128)).astype(mx.bfloat16)
        mx.eval(layers, tables, lengths, q)
        auto = paged_kernels.auto_splits(rows, 8, width)
        row = {"rows": rows, "context": context, "auto": auto}
        for splits in sorted({1, 2, 4, 8, 16, 32, auto}):
            if splits > width:
                continue
            run = lambda: mx.eval([paged_kernels.cuda_attention(q, k, v, tables, lengths, 128 ** -0.5, splits=splits)  # noqa: E731
                                   for k, v in layers])
            run()
            times = []
            for _ in range(15):
                mx.synchronize()
                t0 = time.perf_counter()
                run()
                mx.synchronize()
                times.append(1000 * (time.perf_counter() - t0) / len(layers))
            row[f"splits_{splits}_ms"] = round(statistics.median(times), 4)
        print(row, flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument("--no-sweep", action="store_true", help="the correctness check only")
    args = parser.parse_args(argv)
    record = {"device": str(mx.default_device()), "mlx": mx.__version__}
    record["correctness"] = correctness()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "paged-kernel-check.json").write_text(json.dumps(record, indent=1) + "\n")
    if not args.no_sweep:
        record["splits"] = splits_sweep()
    (args.out_dir / "paged-kernel-check.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
