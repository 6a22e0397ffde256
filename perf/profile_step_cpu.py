"""Where a batch-16 decode step of the default model goes on the CPU, and the environment knobs.

1. `step`: one engine step with 16 running rows (the engine's own loop: forward, sampling,
   bookkeeping), alternating with
2. `forward`: the model pass alone through the engine's cache views (fast math entered), and
3. `matmuls`: the pass's matrix products alone — every Linear of the model with its own
   float32 weights and a [16, in] input, and the tied-embedding output head — so
   `forward - matmuls` is everything else (attention, norms, RoPE, SwiGLU, the KV scatter,
   graph building);
4. the memory-bandwidth limit of the step: the weights' bytes over the best read bandwidth of
   this machine (a NumPy sum over a buffer of that size, on one thread and split over every
   core, best of five), as milliseconds per step and tokens/s at 16 rows.

With `--variants`, the script runs itself in fresh processes under each environment below,
round-robin, `--runs` times each (this VM's speed drifts ~10 % over minutes): `default` (what
parallm's engine gets: OpenBLAS with `OPENBLAS_THREAD_TIMEOUT=16`, workers sleep after ~25 us,
and mimalloc preloaded), `system_malloc` (glibc's malloc instead, `PARALLM_NO_MIMALLOC=1`),
`timeout20` / `24` / `28` (OpenBLAS's default, ~0.1 s of spinning), and `hugepages` (glibc's
malloc with transparent huge pages for MLX's buffers, `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`,
glibc >= 2.35).

    python -m perf.profile_step_cpu --variants   # -> perf/results/step-cpu.json

For the per-symbol split, attach `perf` to a running copy (its third thread, MLX's stream
thread, runs the kernels; the second is OpenBLAS's worker):

    python -m perf.profile_step_cpu --rounds 400 & sleep 40; perf record -g -F 1999 -p $! -- sleep 8
    perf report --no-children --sort pid,symbol -g none
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from perf.harness import ROOT, Results, add_results_options

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "system_malloc": {"PARALLM_NO_MIMALLOC": "1"},
    "timeout20": {"OPENBLAS_THREAD_TIMEOUT": "20"},
    "timeout24": {"OPENBLAS_THREAD_TIMEOUT": "24"},
    "timeout28": {"OPENBLAS_THREAD_TIMEOUT": "28"},
    "hugepages": {"PARALLM_NO_MIMALLOC": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}
VARIED = {key for extra in VARIANTS.values() for key in extra}  # unset in every child, then set per variant
ROWS = 16


def linear_weights(model: Any) -> list[Any]:
    """The weight of every Linear of the model, then the output head's (the tied embedding's)."""
    import mlx.nn as nn

    weights = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    inner = getattr(model, "model", model)
    head = getattr(model, "lm_head", None)
    weights.append(head.weight if head is not None else inner.embed_tokens.weight)
    return weights


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second that summing a float32 buffer of `nbytes` reaches, the best of one thread
    and one thread per core (NumPy releases the GIL in reductions)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    buf = np.ones(nbytes // 4, dtype=np.float32)
    workers = len(os.sched_getaffinity(0))
    parts = np.array_split(buf, workers)
    best = float("inf")
    with ThreadPoolExecutor(workers) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            t1 = time.perf_counter()
            list(pool.map(np.sum, parts))
            t2 = time.perf_counter()
            best = min(best, t1 - t0, t2 - t1)
    return buf.nbytes / best


def measure(rounds: int) -> dict[str, float]:
    import mlx.core as mx

    from parallm import blas
    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.engine.cache import LiveKV, PassContext
    from parallm.models import load_model
    from parallm.protocol import SamplingParams

    loaded = load_model(ModelConfig())
    engine = Engine(EngineModel(loaded.model, (), loaded.max_model_len, loaded.vocab_size), Config(engine=EngineConfig(max_num_seqs=ROWS, prefix_cache=False)))
    engine.warm_up()
    runner = engine.runner
    live = LiveKV(runner.info.shapes, runner.info.dtype)
    live.resize(ROWS + 1, 256)
    rng = random.Random(0)
    offsets = [100 + i for i in range(ROWS)]
    tokens = mx.array([[rng.randrange(100, 40000)] for _ in range(ROWS)])

    def forward() -> mx.array:
        return runner.call_model(tokens, live.views(PassContext(0, offsets, 1, max(offsets) + 1)))[:, -1]

    weights = linear_weights(loaded.model)
    inputs = {w.shape[1]: mx.random.normal((ROWS, w.shape[1])) for w in weights}
    mx.eval(list(inputs.values()))

    def matmuls() -> list[mx.array]:
        return [inputs[w.shape[1]] @ w.T for w in weights]

    params = SamplingParams(max_tokens=2 * rounds + 40, temperature=0.0, ignore_eos=True)
    for i in range(ROWS):
        engine.add_request(make_request(rid=f"r{i}", prompt_ids=[rng.randrange(100, 40000) for _ in range(100)],
                                   params=params))
    while engine.stats().running < ROWS:
        engine.step()
    for _ in range(3):
        engine.step()
        mx.eval(forward())
        mx.eval(matmuls())
    times: dict[str, list[float]] = {"step": [], "forward": [], "matmuls": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        engine.step()
        engine.step()
        t1 = time.perf_counter()
        mx.eval(forward())
        t2 = time.perf_counter()
        mx.eval(matmuls())
        t3 = time.perf_counter()
        times["step"].append((t1 - t0) / 2)
        times["forward"].append(t2 - t1)
        times["matmuls"].append(t3 - t2)
    out = {f"{k}_ms": round(1000 * statistics.median(v), 2) for k, v in times.items()}
    out["other_ops_ms"] = round(out["forward_ms"] - out["matmuls_ms"], 2)
    out["matmul_calls"] = len(weights)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    for key in ("VmRSS", "VmHWM"):  # resident after the steps, and at the peak so far
        out[f"{key.lower()}_mb"] = round(int(status[key].split()[0]) / 1024, 1)
    weight_bytes = sum(w.nbytes for w in weights)
    out["weights_mb"] = round(weight_bytes / 1e6, 1)
    bandwidth = read_bandwidth(weight_bytes)
    out["read_gb_s"] = round(bandwidth / 1e9, 1)
    out["bandwidth_limit_step_ms"] = round(1000 * weight_bytes / bandwidth, 2)
    out["bandwidth_limit_tok_s"] = round(ROWS * bandwidth / weight_bytes, 1)
    out["step_tok_s"] = round(1000 * ROWS / out["step_ms"], 1)
    out["allocator"] = blas.preloaded_allocator()
    return out


def run_variants(runs: int, rounds: int) -> dict[str, Any]:
    got: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(runs):
        for name, extra in VARIANTS.items():
            env = {k: v for k, v in os.environ.items() if k not in VARIED}
            env.update(extra)
            proc = subprocess.run([sys.executable, "-m", "perf.profile_step_cpu", "--rounds", str(rounds)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, check=True)
            got[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(name, got[name][-1], flush=True)
    keys = ("step_ms", "forward_ms", "matmuls_ms", "other_ops_ms", "bandwidth_limit_step_ms")
    summary = {name: {key: statistics.median(r[key] for r in rs) for key in keys}
               for name, rs in got.items()}
    return {"variants": VARIANTS, "runs": got, "median": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="measurements of each kind, interleaved")
    parser.add_argument("--variants", action="store_true", help="compare the environment variants")
    parser.add_argument("--runs", type=int, default=2, help="processes per variant (with --variants)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    if args.variants:
        result = {"note": "machine describes the parent; each variant runs in a child re-executed with OpenBLAS "
                          "(and mimalloc unless PARALLM_NO_MIMALLOC), see each run's allocator",
                  **run_variants(args.runs, args.rounds)}
        print(json.dumps(result["median"], indent=1))
        Results.from_args("step", args, argv).write(result)
        return 0
    from parallm import blas

    blas.reexec_with_openblas()
    print(json.dumps(measure(args.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
