"""Per-step launch cost of a decode pass on MLX's CUDA backend under its command-buffer settings.

A batch-1 decode step of a 3B model on an H100 is launch-bound: the host spends longer building
and submitting the step's kernels than the GPU spends running them. MLX's CUDA backend collects
kernels into CUDA graphs and submits one graph per `MLX_MAX_OPS_PER_BUFFER` operations or
`MLX_MAX_MB_PER_BUFFER` megabytes of inputs (H100 defaults: 30 ops, 400 MB), each submission with
a completion callback; `MLX_USE_CUDA_GRAPHS=0` launches kernels one by one. Each setting runs in
a fresh process (MLX reads them once) and reports, on the same random-weight models:

- llama-3.2-3b, one stream of `--max-tokens` tokens through the in-process Engine: tok/s and ms
  per token; the same with the engine stage's per-step message work emulated;
- llama-3.2-3b, 64 rows x 64 tokens: decode tok/s (a setting must not cost the batched case);
- smollm2-135m, 16 rows x 48 tokens: decode tok/s (the adapter benchmark's model);
- with `--served`: the served single stream (parallm-launch, raw ZeroMQ client) under the best
  setting and the default.

    python -m perf.profile_launch --tokenizer-dir DIR --served   # -> perf/results/launch-settings-h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from perf.harness import Results, add_results_options

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "mb_unlimited": {"MLX_MAX_MB_PER_BUFFER": "1000000"},
    "ops100_mb_unlimited": {"MLX_MAX_OPS_PER_BUFFER": "100", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "ops250_mb_unlimited": {"MLX_MAX_OPS_PER_BUFFER": "250", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "ops1000_mb_unlimited": {"MLX_MAX_OPS_PER_BUFFER": "1000", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "no_cuda_graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def child(work_dir: Path, tokenizer_dir: Path, max_tokens: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from perf.bench_gpu import build_model_dir, prompts, run_engine
    from perf.profile_served import engine_run

    out: dict[str, Any] = {}
    model, _ = load_model(build_model_dir("llama-3.2-3b", work_dir / "llama-3.2-3b", tokenizer_dir))
    mx.eval(model.parameters())
    engine_run(model, max_tokens, seed=1)
    out["llama_c1"] = engine_run(model, max_tokens, seed=2)
    out["llama_c1_stage_protocol"] = engine_run(model, max_tokens, seed=2, emulate_stage=True)
    run_engine(model, prompts(64, 128, 3), 16, 4096)
    out["llama_b64"] = run_engine(model, prompts(64, 128, 4), 64, 4096)
    del model
    mx.clear_cache()
    small, _ = load_model(build_model_dir("smollm2-135m", work_dir / "smollm2-135m", tokenizer_dir))
    mx.eval(small.parameters())
    run_engine(small, prompts(16, 16, 5), 16, 2048)
    out["smollm2_b16"] = run_engine(small, prompts(16, 16, 6), 48, 2048)
    out["adapter_load"] = adapter_load(small, work_dir / "smollm2-135m")
    return out


def adapter_load(model, model_dir: Path) -> dict[str, Any]:
    """ms per rank-16 q/v LoRA load (parse, validate, cast) and where it goes (cProfile)."""
    import cProfile
    import io
    import pstats

    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel
    from perf.bench_adapters import lora_blob_for_dir

    engine = Engine(EngineModel(model, (), 2048), Config(engine=EngineConfig(max_num_seqs=16, prefix_cache=False, kv_budget_mb=1024)))
    blobs = [lora_blob_for_dir(model_dir, k) for k in range(12)]
    times = []
    profile = cProfile.Profile()
    for k, (config, blob) in enumerate(blobs):
        if k == 2:
            profile.enable()
        t0 = time.perf_counter()
        engine.load_adapter("pol", config=config, weights=blob)
        times.append(1000 * (time.perf_counter() - t0))
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    return {"ms": [round(t, 2) for t in times], "profile": text.getvalue()}


def run_child(env_extra: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, "-m", "perf.profile_launch", "--child", "--tokenizer-dir", str(args.tokenizer_dir),
           "--work-dir", str(args.work_dir), "--max-tokens", str(args.max_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (proc.stdout + proc.stderr)[-3000:]}


def served_c1(settings: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """perf.profile_served's served single stream, parallm-launch started under `settings`."""
    from perf.bench_gpu import build_model_dir
    from perf.profile_served import served_variant

    model_dir = build_model_dir("llama-3.2-3b", args.work_dir / "llama-3.2-3b", args.tokenizer_dir)
    saved = dict(os.environ)
    os.environ.update(settings)
    try:
        return served_variant(model_dir, args.max_tokens, 256)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-bench-gpu"))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--served", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_results_options(parser)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.work_dir, args.tokenizer_dir, args.max_tokens)), flush=True)
        return 0
    results = Results.from_args("launch-settings", args, argv)
    report: dict[str, Any] = {"settings": {}, "served_c1": {}}

    def save() -> None:
        results.write(report)

    for name in args.settings.split(","):
        report["settings"][name] = r = {"env": SETTINGS[name], **run_child(SETTINGS[name], args)}
        print(name, json.dumps(r), flush=True)
        save()
    if args.served:
        ok = {n: r for n, r in report["settings"].items() if "llama_c1" in r}
        best = max(ok, key=lambda n: ok[n]["llama_c1"]["tok_s"], default="default")
        for name in dict.fromkeys([best, "default"]):
            report["served_c1"][name] = r = served_c1(SETTINGS[name], args)
            print("served", name, json.dumps(r), flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
