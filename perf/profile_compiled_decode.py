"""The engine's decode step eager vs compiled (`engine.compiled_decode`), in-process and served;
with `--compare in-place`, the overlapped decode step with the live KV copied every pass vs written
in place (`engine.in_place_kv_mb`), in-process.

In-process: for each row count, two engines on the same model object (eager, compiled) are
filled with the same prompts; once every row decodes, `--steps` pure decode steps are timed on
each, alternating engine by engine for `--rounds` rounds, so both see the same machine state. The
first steps (for the compiled engine the trace of its bucket, and on CUDA the JIT of its fused
kernels) are timed apart as `first_steps_ms`; `compiled_decode_after_warm_up` against the final
`compiled_decode` counts shows whether a trace fell in the timed steps. Each engine's greedy tokens are compared (`same_tokens`: the
share of rows whose tokens agree; float rounding of the padded shapes may flip a near-tie in
bf16). `--served` then starts `parallm-launch` both ways at once (eager, compiled; each with a
small KV budget) and times one streaming HTTP request at a time against each, alternating.

    python -m perf.profile_compiled_decode --shape tiny --rows 1,16 --steps 24          # this CPU
    python -m perf.profile_compiled_decode --shape llama-3.2-3b --rows 1,16,64 --served --tokenizer-dir .gpu-tok
        # on a GPU: bash perf/gpu_runs.sh compiled -> perf/results/compiled-decode-llama-3.2-3b-h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from parallm.engine.compiled import span_bucket
from perf.bench_gpu import SHAPES
from perf.harness import Results, Server, add_results_options


# the two engines each comparison times: name -> EngineConfig settings
COMPARISONS = {
    "compiled": {"eager": {"compiled_decode": False}, "compiled": {"compiled_decode": True}},
    # the overlapped schedule with the live KV copied by every pass (never waiting) vs written in place
    "in-place": {"copy": {"overlap": True, "in_place_kv_mb": -1}, "in_place": {"overlap": True, "in_place_kv_mb": 0}},
}


def _engine(model, rows: int, max_len: int, settings: dict[str, Any]):
    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel

    kv_mb = max(4096, 2 * rows * max_len * _bytes_per_token(model) / 2**20)
    config = EngineConfig(max_num_seqs=rows, max_prefill_tokens=8192, max_prefill_rows=64, kv_budget_mb=kv_mb,
                          **settings)
    return Engine(EngineModel(model, (), max_len), Config(engine=config))


def _bytes_per_token(model) -> int:
    from parallm.engine.cache import LiveKV
    from parallm.engine.compat import check_model

    info = check_model(model)
    return LiveKV(info.shapes, info.dtype).bytes_per_token


def _fill(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(make_request(rid=str(i), prompt_ids=ids, params=params))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.stats().running < len(prompts) or engine.stats().prefilling or engine.stats().waiting:
        _collect(engine.step(), tokens)
    return tokens


def _collect(outputs, tokens: dict[str, list[int]]) -> None:
    for o in outputs:
        tokens[o.rid].extend(o.token_ids)


def _steps(engine, n: int, tokens: dict[str, list[int]]) -> float:
    """Seconds for n decode steps, the device finished."""
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        _collect(engine.step(), tokens)
    mx.synchronize()
    return time.perf_counter() - start


def inprocess(model, rows: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import random

    rng = random.Random(rows)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(rows)]
    warm = 4
    total = warm + args.rounds * args.steps + 8
    if span_bucket(args.prompt_len + warm + 1, 1 << 30) != span_bucket(args.prompt_len + total, 1 << 30):
        print(f"note: spans {args.prompt_len}..{args.prompt_len + total} cross a key-span bucket: the compiled engine "
              "traces again during the timed steps (fewer --rounds x --steps, or another --prompt-len)", flush=True)
    engines = {name: _engine(model, rows, args.prompt_len + total + 16, settings)
               for name, settings in COMPARISONS[args.compare].items()}
    base, new = engines
    tokens = {name: _fill(e, prompts, total) for name, e in engines.items()}
    first = {name: 1000 * _steps(e, warm, tokens[name]) / warm for name, e in engines.items()}
    traced = dict(engines[new].stats().compiled_decode)
    per_step: dict[str, list[float]] = {name: [] for name in engines}
    peak: dict[str, float] = {name: 0.0 for name in engines}  # device memory above the steps' start
    for _ in range(args.rounds):
        for name, e in engines.items():
            mx.synchronize()
            mx.reset_peak_memory()
            start = mx.get_active_memory()
            per_step[name].append(1000 * _steps(e, args.steps, tokens[name]) / args.steps)
            peak[name] = max(peak[name], (mx.get_peak_memory() - start) / 1e9)
    for name, e in engines.items():
        while e.has_work():
            _collect(e.step(), tokens[name])
    same = sum(tokens[base][k] == tokens[new][k] for k in tokens[base]) / rows
    entry: dict[str, Any] = {"rows": rows, "same_tokens": same, "compiled_decode_after_warm_up": traced}
    for name, e in engines.items():
        ms = statistics.median(per_step[name])
        stats = e.stats()
        entry[name] = {"step_ms": ms, "step_ms_rounds": per_step[name], "tok_s": rows * 1000 / ms,
                       "first_steps_ms": first[name], "phases_ms": stats.step_ms_mean,
                       "compiled_decode": stats.compiled_decode, "peak_above_start_gb": peak[name],
                       "live_kv_gb": e.runner.live.nbytes / 1e9}
    entry["speedup"] = entry[base]["step_ms"] / entry[new]["step_ms"]
    return entry


def served(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One streaming HTTP request at a time against an eager and a compiled server, alternating."""
    from perf.loadgen import Workload, run_http

    workload = Workload("chat", prompt_words=40, max_tokens=args.served_tokens, requests=args.served_requests)
    servers = {name: Server("--model.path", str(model_dir), "--model.served-name", "bench",
                            "--engine.max-num-seqs", "4", "--engine.kv-budget-mb", "2048",
                            "--engine.compiled-decode", "true" if name == "compiled" else "false",
                            "--supervisor.stall-after-s", "0", ready_timeout=900)
               for name in ("eager", "compiled")}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            # warm-up as long as a measured request, so every span bucket it reaches is traced before timing
            asyncio.run(run_http(s.url, "bench", Workload("chat", 40, args.served_tokens, 1), 1, [2], seed=99))
        runs: dict[str, list[dict[str, Any]]] = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            for name, s in servers.items():
                runs[name].append(asyncio.run(run_http(s.url, "bench", workload, 1, [2], seed=r)))
                print(name, json.dumps(runs[name][-1]), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    out: dict[str, Any] = {"max_tokens": args.served_tokens, "requests_per_round": args.served_requests}
    for name, rs in runs.items():
        out[name] = {"tok_s": statistics.median(x["throughput_tok_s"] for x in rs),
                     "tok_s_rounds": [x["throughput_tok_s"] for x in rs],
                     "itl_p50_ms": 1000 * statistics.median(x["itl_p50_s"] for x in rs),
                     "ttft_p50_ms": 1000 * statistics.median(x["ttft_p50_s"] for x in rs)}
    out["speedup"] = out["compiled"]["tok_s"] / out["eager"]["tok_s"] if out["eager"]["tok_s"] else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="compiled",
                        help="compiled: engine.compiled_decode off vs on; in-place: the overlapped schedule with "
                             "engine.in_place_kv_mb -1 (every pass copies the live KV) vs 0 (written in place)")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per engine per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=136,
                        help="prompt tokens per row (136: with rounds x steps <= 112 every timed step's key span "
                             "stays in the 256 bucket)")
    parser.add_argument("--served", action="store_true", help="also a single HTTP stream, eager vs compiled server")
    parser.add_argument("--served-tokens", type=int, default=128)
    parser.add_argument("--served-requests", type=int, default=3, help="sequential requests per server per round")
    parser.add_argument("--tokenizer-dir", type=Path, help="the tokenizer files (default: the default model's)")
    parser.add_argument("--work-dir", type=Path, default=None)
    add_results_options(parser, default_help="SHAPE")
    args = parser.parse_args(argv)
    if mx.default_device() == mx.cpu:
        from parallm import blas

        blas.reexec_with_openblas()
    from parallm.config import ModelConfig
    from parallm.models import load_model
    from perf.bench_serving import shape_model_dir

    model_dir = shape_model_dir(args)
    loaded = load_model(ModelConfig(path=str(model_dir)))
    bench = "compiled-decode" if args.compare == "compiled" else "in-place-kv"
    results = Results.from_args(bench, args, argv, experiment=args.experiment or args.shape)
    report: dict[str, Any] = {"compare": args.compare, "shape": args.shape, "prompt_len": args.prompt_len, "steps": args.steps,
                              "rounds": args.rounds, "inprocess": []}
    for rows in [int(r) for r in args.rows.split(",")]:
        entry = inprocess(loaded.model, rows, args, loaded.vocab_size)
        report["inprocess"].append(entry)
        print(json.dumps(entry), flush=True)
        results.write(report)
        gc.collect()
    if args.served and args.compare == "compiled":
        del loaded
        gc.collect()
        mx.clear_cache()
        report["served_single_stream"] = served(model_dir, args)
        print(json.dumps(report["served_single_stream"]), flush=True)
    results.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
