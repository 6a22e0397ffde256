"""What the live KV writes cost a decode step: `buf[rows, :, positions] = kv` against one Scatter
over indices built once per pass (parallm/engine/cache.write_index), side by side in one process.

The first form puts a slice between two index arrays, so MLX turns the slice into a uint32
arange, promotes all three indices to int64 and broadcasts and casts each, in every layer's two
writes of every pass. On a GPU a small-batch decode step is bound by the kernels it launches,
so this counts, for one decode pass of the in-process engine (the arrays its `mx.async_eval`
launches), the graph's primitives and those that run a kernel (views — reshape, broadcast,
slice, transpose and the like — run none), and times decode steps at each batch, the two forms
alternating `--rounds` times. On the CPU, MLX's fast kernels (RMSNorm, RoPE, attention) are
graphs of plain ops, so the totals are larger than a GPU's; the difference between the forms is
the same.

    python -m perf.profile_kv_writes                       # -> perf/results/kv-writes-cpu.{json,md}
    python -m perf.profile_kv_writes --shape llama-3.2-3b --dtype bfloat16 --batches 1,64   # a GPU
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from perf.bench_gpu import SHAPES
from perf.harness import Results, add_results_options, describe
from perf.profile_decode import decoding_engine

VIEWS = {"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "Transpose", "Flatten", "Unflatten",
         "AsStrided", "Copy"}  # primitives that share their input's buffer (a Copy of a contiguous input)


def slice_between_writes(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """RowsView.update_and_fetch as it was before write_index (the baseline)."""
    ctx, live, i = self._ctx, self._live, self._layer
    k_buf, v_buf = live.keys[i], live.values[i]
    if ctx.length == 1:
        k_buf[ctx.rows, :, ctx.positions] = keys[:, :, 0, :]
        v_buf[ctx.rows, :, ctx.positions] = values[:, :, 0, :]
    else:
        rows = mx.broadcast_to(ctx.rows[:, None], ctx.positions.shape)
        k_buf[rows, :, ctx.positions] = keys.transpose(0, 2, 1, 3)
        v_buf[rows, :, ctx.positions] = values.transpose(0, 2, 1, 3)
    live.keys[i], live.values[i] = k_buf, v_buf
    r0, r1, t = ctx.row0, ctx.row0 + ctx.n, ctx.span
    self._fetched = k_buf[r0:r1, :, :t], v_buf[r0:r1, :, :t]
    return self._fetched


def primitives(arrays: list[mx.array]) -> collections.Counter:
    with tempfile.NamedTemporaryFile("r+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        text = Path(f.name).read_text()
    return collections.Counter(m.group(1) for line in text.splitlines()
                               if "shape=rectangle" in line and (m := re.search(r'label ="([^"]*)"', line)))


def _arrays(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for x in tree for a in _arrays(x)]
    if isinstance(tree, dict):
        return [a for x in tree.values() for a in _arrays(x)]
    return []


def build_model(shape: str, dtype: str):
    spec = {k: v for k, v in SHAPES[shape].items() if k not in ("dtype", "quantize_bits")}
    arch = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(spec))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def one_pass(engine) -> dict[str, int]:
    """The primitives of the decode pass one step launches."""
    launched: list[collections.Counter] = []
    real = mx.async_eval

    def spy(*args):
        launched.append(primitives(_arrays(args)))
        return real(*args)

    mx.async_eval = spy
    try:
        engine.step()
    finally:
        mx.async_eval = real
    ops = launched[-1]
    return {"primitives": sum(ops.values()), "kernels": sum(n for op, n in ops.items() if op not in VIEWS),
            "scatter_side": sum(ops[op] for op in ("AsType", "Arange", "Scatter"))}


def step_ms(engine, steps: int) -> float:
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    mx.synchronize()
    return 1000 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    from parallm import blas

    if not blas.is_preloaded() and blas.openblas_env() is not None:
        blas.reexec_with_openblas()  # MLX's Linux CPU wheel links a reference BLAS ~15-60x slower
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    add_results_options(parser)
    args = parser.parse_args(argv)
    from parallm.engine.cache import RowsView

    current = RowsView.update_and_fetch
    forms = {"slice-between": slice_between_writes, "write-index": current}
    results = Results.from_args("kv-writes", args, argv)
    model = build_model(args.shape, args.dtype)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        engines, times, counts = {}, {name: [] for name in forms}, {}
        for name, form in forms.items():
            RowsView.update_and_fetch = form
            engines[name] = decoding_engine(model, batch, args.steps * args.rounds + 8, args.prompt_len, prefix_cache=False)
            counts[name] = one_pass(engines[name])
        for _ in range(args.rounds):
            for name, form in forms.items():
                RowsView.update_and_fetch = form
                times[name].append(step_ms(engines[name], args.steps))
        RowsView.update_and_fetch = current
        for name in forms:
            row = {"batch": batch, "form": name, **counts[name], "step_ms_median": round(statistics.median(times[name]), 3),
                   "step_ms": [round(t, 3) for t in times[name]]}
            rows.append(row)
            print(row, flush=True)
        del engines
    table = ["| batch | KV write form | primitives | kernels | AsType+Arange+Scatter | step ms (median) |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['form']} | {r['primitives']} | {r['kernels']} | {r['scatter_side']} | "
              f"{r['step_ms_median']} |" for r in rows]
    md = [f"# One decode pass of the {args.shape} shape ({args.dtype}): the live KV writes' two forms", "",
          f"Machine: {describe(results.machine)}", "", f"Command: `{results.command}`", "", *table]
    results.write({"shape": args.shape, "dtype": args.dtype, "rows": rows}, "\n".join(md))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
