"""The engine's decode step with `engine.fused_projections` off and on (issue 37 item 3).

Two in-process engines on one model (greedy rows, decoding), their steps timed in alternating
segments (`--rounds` x `--steps` each, one engine then the other); per row count the median and
every segment's ms per step, and the primitives one decode pass's graph holds (what the host
builds and, on a GPU, mostly launches: matmuls, their flatten/unflatten, the transposes of the
weights), counted from `mx.export_to_dot` of the pass's logits.

    python -m perf.bench_fused_projections --rows 1,16 --rounds 5      # the default model, this CPU
    python -m perf.bench_fused_projections --shape llama-3.2-3b --tokenizer-dir DIR --rows 1   # a GPU
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from perf.harness import Results, add_results_options, graph_primitives

WAYS = ("unfused", "fused")


def pass_graph(engine) -> collections.Counter:
    """The primitives of the next decode step's forward pass (its logits), counted before it runs."""
    runner = engine.runner
    seen: list[collections.Counter] = []
    forward = runner._forward

    def counting(*args, **kwargs):
        logits = forward(*args, **kwargs)
        seen.append(graph_primitives([logits]))
        return logits

    runner._forward = counting
    try:
        engine.step()
    finally:
        del runner._forward
    mx.synchronize()
    return seen[-1]


def load(args: argparse.Namespace):
    if args.shape == "default":
        from parallm.config import ModelConfig
        from parallm.models import load_model

        return load_model(ModelConfig()).model
    from mlx_lm.utils import load_model

    from perf.bench_gpu import build_model_dir

    model, _ = load_model(build_model_dir(args.shape, args.work_dir / args.shape, args.tokenizer_dir))
    return model


def main(argv: list[str] | None = None) -> int:
    from perf.bench_gpu import SHAPES
    from perf.profile_decode import decoding_engine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["default", *sorted(SHAPES)], default="default",
                        help="default: the embedded default model as served (its dtype policy); else perf.bench_gpu's "
                             "random-weight shape (needs --tokenizer-dir)")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed segment")
    parser.add_argument("--rounds", type=int, default=5, help="segments per engine, alternating")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokenizer-dir", type=Path)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-bench-gpu"))
    add_results_options(parser, default_help="SHAPE")
    args = parser.parse_args(argv)
    model = load(args)
    results = Results.from_args("fused-projections", args, argv, experiment=args.shape)
    report: dict = {"shape": args.shape, "steps": args.steps, "rounds": args.rounds, "prompt_len": args.prompt_len,
                    "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        room = args.steps * args.rounds + 8
        engines = {way: decoding_engine(model, rows, room, args.prompt_len, fused_projections=way == "fused")
                   for way in WAYS}
        entry: dict = {"graph": {}, "segments_ms": {way: [] for way in WAYS}}
        for way, engine in engines.items():
            entry["fused_groups"] = entry.get("fused_groups") or (
                len(engine.runner.fused.groups) if engine.runner.fused is not None else 0)
            ops = pass_graph(engine)
            entry["graph"][way] = {"primitives": sum(ops.values()),
                                   **{k: ops[k] for k in ("Matmul", "QuantizedMatmul", "AddMM", "Split", "Slice",
                                                          "Transpose", "Flatten", "Unflatten") if ops[k]}}
        for _ in range(args.rounds):
            for way, engine in engines.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                mx.synchronize()
                entry["segments_ms"][way].append(round(1000 * (time.perf_counter() - start) / args.steps, 3))
        for way in WAYS:
            entry[f"{way}_ms"] = statistics.median(entry["segments_ms"][way])
        entry["fused_over_unfused"] = round(entry["fused_ms"] / entry["unfused_ms"], 3)
        report["rows"][str(rows)] = entry
        print(rows, {k: entry[k] for k in ("unfused_ms", "fused_ms", "fused_over_unfused", "graph")}, flush=True)
        del engines
        results.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
