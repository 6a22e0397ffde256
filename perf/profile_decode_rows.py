"""What a decode batch's first use costs: the warm-up's row ramp (engine.warm_decode_rows) timed step by step,
twice on one engine.

Served, requests reach the engine unevenly, so its decode passes take row counts it has not run before for
long after its start (issue 37: 17-34 steps a run marked new in the served engine's figures at c=256 on
the H200, none in the in-process engine's repeated runs, whose arrivals repeat). This builds the engine
the way the engine stage does (the device's defaults, `warm_up()` without the ramp), then runs the ramp
(`parallm.engine.warmup.warm_up_decode_rows`: one request admitted per step, the decode batch growing by
one row a step) `--ramps` times and times each step. The first ramp meets every row count for the first
time, the later ones do not: their difference per step is what a first use costs.

    python -m perf.profile_decode_rows --shape tiny --rows 32                       # this CPU
    python -m perf.profile_decode_rows --shape llama-3.2-3b --rows 256 --tokenizer-dir .gpu-tok
        # on a GPU: bash perf/gpu_runs.sh lean37 -> perf/results/decode-rows-llama-3.2-3b-h200.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from perf.harness import Results, add_results_options


def timed_ramp(engine: Any, rows: int) -> list[tuple[int, float]]:
    """(decode rows, ms) of each step of one ramp."""
    from parallm.engine.warmup import warm_up_decode_rows

    steps: list[tuple[int, float]] = []
    step, decode = engine.step, engine.trace.decode
    seen = [0]

    def record_rows(n: int) -> None:
        seen[0] = n
        decode(n)

    def timed_step(*a: Any, **kw: Any) -> Any:
        seen[0] = 0
        t0 = time.perf_counter()
        out = step(*a, **kw)
        steps.append((seen[0], 1000 * (time.perf_counter() - t0)))
        return out

    engine.step, engine.trace.decode = timed_step, record_rows
    try:
        warm_up_decode_rows(engine, rows)
    finally:
        engine.step, engine.trace.decode = step, decode
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="a perf.bench_gpu shape (random weights)")
    parser.add_argument("--rows", type=int, default=256, help="the ramp's largest decode batch")
    parser.add_argument("--ramps", type=int, default=3)
    parser.add_argument("--kv-budget-mb", type=float, default=None)
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--tokenizer-dir", default="")
    add_results_options(parser)
    args = parser.parse_args(argv)

    from parallm import blas

    blas.reexec_with_openblas()
    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model
    from perf.bench_serving import shape_model_dir

    model_config = ModelConfig(path=str(shape_model_dir(args)))
    loaded = load_model(model_config)
    engine = Engine(EngineModel.of(loaded), Config(model=model_config, engine=EngineConfig(
        max_num_seqs=args.rows, kv_budget_mb=args.kv_budget_mb)))
    warm_s = engine.warm_up()
    results = Results.from_args(f"decode-rows-{args.shape}", args, argv)
    ramps = []
    for r in range(args.ramps):
        t0 = time.perf_counter()
        steps = timed_ramp(engine, args.rows)
        ramps.append({"seconds": time.perf_counter() - t0, "steps": steps})
        print(f"ramp {r}: {len(steps)} steps in {ramps[-1]['seconds']:.2f} s", file=sys.stderr)
    # a step of the ramp's growing part: decode rows k (1..rows-1) beside a one-row prefill
    by_rows = [{k: ms for k, ms in ramp["steps"] if k} for ramp in ramps]
    common = sorted(set.intersection(*(set(b) for b in by_rows)))
    first_extra = [by_rows[0][k] - statistics.median(b[k] for b in by_rows[1:]) for k in common] if len(ramps) > 1 else []
    summary = {"ramp_seconds": [round(x["seconds"], 3) for x in ramps],
               "median_step_ms": [round(statistics.median(b.values()), 3) for b in by_rows],
               "first_ramp_extra_ms_median": round(statistics.median(first_extra), 3) if first_extra else None,
               "first_ramp_extra_ms_total": round(sum(first_extra), 1) if first_extra else None,
               "row_counts": len(common)}
    settings = {k: getattr(engine.config, k) for k in ("overlap", "unfused_decode", "paged_decode", "block_size")}
    results.write({"shape": args.shape, "rows": args.rows, "warm_up_s": warm_s, "settings": settings,
                   "summary": summary, "ramps": ramps},
                  "\n".join([f"# A decode batch's first use: the warm-up's row ramp to {args.rows} rows, "
                             f"{args.ramps} times ({args.shape})", "", f"`{results.command}`", "",
                             "| ramp | seconds | median step ms |", "|---:|---:|---:|",
                             *(f"| {i} | {s:.3f} | {m:.3f} |" for i, (s, m) in enumerate(
                                 zip(summary["ramp_seconds"], summary["median_step_ms"]))), "",
                             f"First ramp over the later ones' median, per row count ({summary['row_counts']} "
                             f"counts): median {summary['first_ramp_extra_ms_median']} ms, total "
                             f"{summary['first_ramp_extra_ms_total']} ms.", ""]))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
