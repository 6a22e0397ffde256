"""Where a decode step's time goes: Python (cProfile of the engine loop) against device time.

Builds the random-weight model of perf.bench_gpu's `--shape`, fills the engine with `--batch`
sequences, then profiles `--steps` pure decode steps and prints the engine's own phase timings,
the step time with and without overlap, and the top functions by own time.

    python -m perf.profile_decode --shape llama-3.2-3b --batch 256 --tokenizer-dir DIR
        # -> perf/results/decode-profile-llama-3.2-3b-b256-h100.json
    python perf/profile_decode.py ... --default-only --engine paged_decode=off   # one engine's step, settings given
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx
import msgspec

from perf.bench_gpu import SHAPES, build_model_dir, prompts
from perf.harness import Results, add_results_options


def decoding_engine(model, batch: int, steps: int, prompt_len: int, **engine_options):
    """An in-process engine whose `batch` rows have all prefilled and decoded 5 steps, with room for
    `steps` more greedy decode steps (EngineConfig fields in `engine_options`)."""
    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.protocol import SamplingParams

    config = msgspec.structs.replace(EngineConfig(max_num_seqs=batch, max_prefill_tokens=8192), **engine_options)
    engine = Engine(EngineModel(model, (), prompt_len + steps + 64), Config(engine=config))
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts(batch, prompt_len, 1)):
        engine.add_request(make_request(rid=str(i), prompt_ids=ids, params=params))
    while engine.stats().running < batch or engine.stats().prefilling:
        engine.step()
    for _ in range(5):
        engine.step()
    return engine


def phase_ms(before, after, steps: int) -> dict[str, float]:
    """Each step phase's mean milliseconds over the `steps` between two EngineStats."""
    total = {k: v * after.steps for k, v in after.step_ms_mean.items()}
    return {k: (v - before.step_ms_mean.get(k, 0.0) * before.steps) / steps for k, v in total.items()}


def decode_steps(model, batch: int, steps: int, prompt_len: int, **engine_options) -> tuple[object, float, dict]:
    engine = decoding_engine(model, batch, steps, prompt_len, **engine_options)
    before = engine.stats()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    mx.synchronize()
    return engine, (time.perf_counter() - start) / steps, phase_ms(before, engine.stats(), steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-bench-gpu"))
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="an EngineConfig setting of every engine (repeatable; e.g. paged_decode=off)")
    parser.add_argument("--default-only", action="store_true",
                        help="time the default engine only (no overlap/compile variants, no cProfile)")
    add_results_options(parser, default_help="SHAPE-bBATCH")
    args = parser.parse_args(argv)
    settings = {k: _value(v) for k, _, v in (e.partition("=") for e in args.engine)}
    from mlx_lm.utils import load_model

    model, _ = load_model(build_model_dir(args.shape, args.work_dir / args.shape, args.tokenizer_dir))
    results = Results.from_args("decode-profile", args, argv, experiment=f"{args.shape}-b{args.batch}")
    report = {"shape": args.shape, "batch": args.batch, "engine": settings}
    variants = (("default", {}), ("no_overlap", {"overlap": False}), ("no_compile", {"compile": False}))
    for name, opts in variants[:1] if args.default_only else variants:
        engine, per_step, phases = decode_steps(model, args.batch, args.steps, args.prompt_len, **settings, **opts)
        report[name] = {"step_ms": 1000 * per_step, "tok_s": args.batch / per_step, "phases_ms": phases}
        if name == "default":
            report["paged_decode"] = getattr(engine.runner, "paged_way", None) \
                if getattr(engine.runner, "pages_decode", False) else None
        print(name, json.dumps(report[name]), flush=True)
        del engine
    if args.default_only:
        results.write(report)
        return 0
    engine, _, _ = decode_steps(model, args.batch, 3, args.prompt_len, **settings)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    mx.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    report["profile_top"] = text.getvalue()
    print(text.getvalue())
    results.write(report)
    return 0


def _value(text: str):
    """A setting's value: JSON (numbers, true/false) where it parses, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


if __name__ == "__main__":
    sys.exit(main())
