"""In-process engine benchmark on the embedded default model (SmolLM2-135M-Instruct).

Measures, in one run and on the same loaded model object:
  a. decode throughput of parallm's Engine vs mlx-lm's BatchGenerator at batch 1/8/32;
  b. the Engine's `overlap` and `compile` switches at batch 8/32;
  c. time to first token with a 1,000-token shared prefix, cold vs prefix-cache hit;
  d. float32 vs quantized weights (OpenBLAS), and float32 on MLX's reference BLAS
     (a child process started without the OpenBLAS preload, tiny workload).

Every workload is greedy or fixed-seed, EOS suppressed (ignore_eos / no stop tokens), so all
runs do equal work. Each point is the median of repeats (the machine may be shared).

    python -m perf.bench_engine [--quick] [--only a]   # -> perf/results/engine-cpu.{json,md,png}
    python -m perf.bench_engine --no-openblas --only refblas   # what the child runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

from parallm import blas
from perf.engine_report import blas_description, markdown, plot
from perf.harness import Results, add_results_options
from perf.loadgen import WORDS

KV_BUDGET = 1536 << 20  # 1.5 GiB: live rows + prefix pool, fixed so runs are comparable
MAX_MODEL_LEN = 4096



# ---------------------------------------------------------------------------- helpers

def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return []


def median_of(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Median of each numeric metric over repeats, plus the raw values."""
    keys = runs[0].keys()
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["repeats"] = len(runs)
    out["raw"] = {k: [round(r[k], 4) for r in runs] for k in keys}
    return out


class Prompts:
    """Fixed-seed text prompts tokenized with the model's tokenizer, cut to exact token counts."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def text_ids(self, n_tokens: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        ids: list[int] = []
        while len(ids) < n_tokens:
            words = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
            ids += self.tok.encode(f" {words}.", add_special_tokens=False)
        return ids[:n_tokens]

    def batch(self, batch: int, n_tokens: int, seed: int) -> list[list[int]]:
        return [self.text_ids(n_tokens, seed * 1000 + i) for i in range(batch)]


# ---------------------------------------------------------------------------- the two generators

def make_engine(lm, **overrides):
    import msgspec

    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel

    config = msgspec.structs.replace(EngineConfig(), **overrides)
    return Engine(EngineModel(lm.model, tuple(lm.eos_token_ids), min(lm.max_model_len, MAX_MODEL_LEN), lm.vocab_size), Config(engine=msgspec.structs.replace(config, kv_budget_mb=KV_BUDGET / (1 << 20))))


def _throughput(t0: float, first: dict[Any, float], t_end: float, total: int, batch: int) -> dict[str, float]:
    t_all_first = max(first.values())
    decode_tokens = total - batch  # every sequence's first token comes from prefill
    decode_s = t_end - t_all_first
    return {
        "wall_s": t_end - t0,
        "e2e_tok_s": total / (t_end - t0),
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "ttft_mean_s": statistics.fmean(t - t0 for t in first.values()),
        "ttft_last_s": t_all_first - t0,
        "tokens": float(total),
    }


def run_engine(lm, prompts: list[list[int]], max_tokens: int, *, engine=None, sampled: bool = False,
               **overrides) -> dict[str, float]:
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    engine = engine or make_engine(lm, **overrides)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        params = (SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True) if sampled
                  else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        engine.add_request(make_request(f"r{i}", list(ids), params=params))
    first: dict[str, float] = {}
    total = 0
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.token_ids:
                total += len(o.token_ids)
                first.setdefault(o.rid, now)
    t_end = time.perf_counter()
    assert total == len(prompts) * max_tokens, (total, len(prompts), max_tokens)
    out = _throughput(t0, first, t_end, total, len(prompts))
    out["max_decode_batch"] = float(engine.stats().max_decode_batch)
    return out


def run_batchgen(lm, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """mlx-lm 0.32's BatchGenerator: greedy sampler, no stop tokens, its default prefill batching."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(lm.model, max_tokens=max_tokens, stop_tokens=None,
                         completion_batch_size=max(32, len(prompts)))
    try:
        t0 = time.perf_counter()
        uids = gen.insert([list(p) for p in prompts], max_tokens=[max_tokens] * len(prompts))
        first: dict[int, float] = {}
        done: set[int] = set()
        total = 0
        while len(done) < len(uids):
            responses = gen.next_generated()
            now = time.perf_counter()
            for r in responses:
                total += 1
                first.setdefault(r.uid, now)
                if r.finish_reason is not None:
                    done.add(r.uid)
        t_end = time.perf_counter()
    finally:
        gen.close()
        del gen
        mx.clear_cache()
    assert total == len(prompts) * max_tokens, (total, len(prompts), max_tokens)
    return _throughput(t0, first, t_end, total, len(prompts))


def repeat(fn: Callable[[], dict[str, float]], n: int, what: str) -> dict[str, Any]:
    runs = []
    for i in range(n):
        r = fn()
        log(f"  {what} #{i + 1}: e2e {r['e2e_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.1f} tok/s")
        runs.append(r)
    return median_of(runs)


# ---------------------------------------------------------------------------- sections

def section_a(lm, P: Prompts, args) -> dict[str, Any]:
    """Engine vs BatchGenerator, interleaved per repeat so both see the same machine load."""
    out = {}
    for batch in args.batches:
        prompts = P.batch(batch, args.prompt_tokens, seed=batch)
        run_engine(lm, prompts, 8)  # warm-up (shapes, kernels)
        run_batchgen(lm, prompts, 8)
        eng_runs, bg_runs = [], []
        for i in range(args.repeats):
            for name, fn, runs in (("parallm", lambda: run_engine(lm, prompts, args.max_tokens), eng_runs),
                                   ("BatchGenerator", lambda: run_batchgen(lm, prompts, args.max_tokens), bg_runs)):
                r = fn()
                log(f"  a batch {batch} {name} #{i + 1}: e2e {r['e2e_tok_s']:.1f}, decode {r['decode_tok_s']:.1f} tok/s")
                runs.append(r)
        eng, bg = median_of(eng_runs), median_of(bg_runs)
        out[str(batch)] = {
            "parallm": eng, "batchgen": bg,
            "ratio_e2e": eng["e2e_tok_s"] / bg["e2e_tok_s"],
            "ratio_decode": eng["decode_tok_s"] / bg["decode_tok_s"],
            # ratio per repeat pair (same moment, same load), then the median
            "ratio_decode_paired_median": statistics.median(
                e["decode_tok_s"] / b["decode_tok_s"] for e, b in zip(eng_runs, bg_runs)),
        }
        log(f"a batch {batch}: parallm/BatchGenerator decode {out[str(batch)]['ratio_decode']:.2f}x, "
            f"e2e {out[str(batch)]['ratio_e2e']:.2f}x")
    return out


def section_b(lm, P: Prompts, args) -> dict[str, Any]:
    """overlap x compile, sampled (temperature 0.8, fixed seeds) so the compiled sampler is used."""
    out = {}
    variants = [("overlap+compile", True, True), ("overlap", True, False), ("compile", False, True),
                ("neither", False, False)]
    for batch in args.switch_batches:
        prompts = P.batch(batch, args.prompt_tokens, seed=100 + batch)
        run_engine(lm, prompts, 8, sampled=True)
        runs: dict[str, list] = {name: [] for name, _, _ in variants}
        for i in range(args.switch_repeats):
            for name, ov, co in variants:
                r = run_engine(lm, prompts, args.switch_tokens, sampled=True, overlap=ov, compile=co)
                log(f"  b batch {batch} {name} #{i + 1}: decode {r['decode_tok_s']:.1f} tok/s")
                runs[name].append(r)
        res = {name: median_of(rs) for name, rs in runs.items()}
        base = res["neither"]["decode_tok_s"]
        res["gain_overlap"] = res["overlap"]["decode_tok_s"] / res["neither"]["decode_tok_s"]
        res["gain_compile"] = res["compile"]["decode_tok_s"] / res["neither"]["decode_tok_s"]
        res["gain_both"] = res["overlap+compile"]["decode_tok_s"] / base
        out[str(batch)] = res
        log(f"b batch {batch}: overlap {res['gain_overlap']:.3f}x, compile {res['gain_compile']:.3f}x, "
            f"both {res['gain_both']:.3f}x")
    return out


def _ttft(engine, rid: str, ids: list[int], max_tokens: int = 4) -> tuple[float, dict]:
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    before = engine.stats()
    t0 = time.perf_counter()
    engine.add_request(make_request(rid, ids, params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True)))
    ttft = None
    while engine.has_work():
        outs = engine.step()
        if ttft is None and any(o.rid == rid and o.token_ids for o in outs):
            ttft = time.perf_counter() - t0
    after = engine.stats()
    delta = {k: getattr(after, k) - getattr(before, k)
             for k in ("prefix_hit_tokens", "prefix_queried_tokens", "prompt_tokens_computed")}
    return ttft, delta


def section_c(lm, P: Prompts, args) -> dict[str, Any]:
    runs = []
    for i in range(args.repeats):
        engine = make_engine(lm)
        _ttft(engine, "warm", P.text_ids(600, 7777), 2)  # warm-up, unrelated tokens
        prefix = P.text_ids(args.prefix_tokens, 5000 + i)  # a fresh prefix per repeat: the first use is cold
        a = prefix + P.text_ids(args.suffix_tokens, 6000 + i)
        b = prefix + P.text_ids(args.suffix_tokens, 7000 + i)
        cold, _ = _ttft(engine, f"a{i}", a)
        hit, d = _ttft(engine, f"b{i}", b)
        log(f"  c #{i + 1}: cold {cold * 1000:.0f} ms, hit {hit * 1000:.0f} ms ({d['prefix_hit_tokens']} tokens cached)")
        runs.append({"cold_ttft_s": cold, "hit_ttft_s": hit, "ratio": hit / cold,
                     "prefix_hit_tokens": float(d["prefix_hit_tokens"]),
                     "prompt_tokens_computed_hit": float(d["prompt_tokens_computed"])})
    res = median_of(runs)
    res["prompt_tokens"] = args.prefix_tokens + args.suffix_tokens
    res["ratio_of_medians"] = res["hit_ttft_s"] / res["cold_ttft_s"]
    return res


def section_d(lm32, P: Prompts, args) -> dict[str, Any]:
    from parallm.config import ModelConfig
    from parallm.models import load_model

    lmq = load_model(ModelConfig(dtype="quantized"))
    log(f"quantized model loaded ({lmq.dtype})")
    out: dict[str, Any] = {"quantized_stored": "Q4_1 GGUF as MLX 4-bit affine quantization"}
    for batch in args.dtype_batches:
        prompts = P.batch(batch, args.dtype_prompt_tokens, seed=200 + batch)
        for name, lm in (("float32", lm32), ("quantized", lmq)):
            run_engine(lm, prompts, 1)
        runs: dict[str, list] = {"float32": [], "quantized": []}
        for i in range(args.dtype_repeats):
            for name, lm in (("float32", lm32), ("quantized", lmq)):
                r = run_engine(lm, prompts, args.dtype_tokens)
                log(f"  d batch {batch} {name} #{i + 1}: decode {r['decode_tok_s']:.1f} tok/s")
                runs[name].append(r)
        res = {name: median_of(rs) for name, rs in runs.items()}
        res["float32_over_quantized_decode"] = res["float32"]["decode_tok_s"] / res["quantized"]["decode_tok_s"]
        out[f"batch{batch}"] = res
    del lmq
    # the same tiny workload the reference-BLAS child runs, here with OpenBLAS
    out["tiny_openblas"] = tiny_workload(lm32, P, args.dtype_repeats)
    out["tiny_reference_blas"] = refblas_child(args, openblas=False)
    out["tiny_openblas_default_threads"] = refblas_child(args, openblas=True)
    ref = out["tiny_reference_blas"]
    if isinstance(ref, dict) and "decode_tok_s" in ref:
        out["openblas_speedup_decode"] = out["tiny_openblas"]["decode_tok_s"] / ref["decode_tok_s"]
        out["openblas_speedup_e2e"] = out["tiny_openblas"]["e2e_tok_s"] / ref["e2e_tok_s"]
    return out


TINY = {"batch": 16, "prompt_tokens": 4, "max_tokens": 8}


def tiny_workload(lm, P: Prompts, repeats: int) -> dict[str, Any]:
    prompts = P.batch(TINY["batch"], TINY["prompt_tokens"], seed=900)
    run_engine(lm, prompts, 2)
    res = repeat(lambda: run_engine(lm, prompts, TINY["max_tokens"]), repeats, "tiny float32")
    res["workload"] = dict(TINY)
    return res


def refblas_child(args, openblas: bool = False) -> dict[str, Any]:
    """Re-run this script for the tiny workload only: without the OpenBLAS preload, or (openblas=True)
    with it at OpenBLAS's default thread count (one per core)."""
    if openblas:
        cmd = [sys.executable, "-m", "perf.bench_engine", "--blas-threads", "0", "--only", "refblas",
               "--repeats", str(args.ref_repeats)]
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARK, "OPENBLAS_NUM_THREADS")}
        log(f"default-threads OpenBLAS child: {shlex.join(cmd)}")
        return _run_child(cmd, env)
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD", "")
    mark = env.pop(blas.MARK, "")
    env["LD_PRELOAD"] = ":".join(p for p in preload.split(":") if p and p != mark and "openblas" not in p)
    if not env["LD_PRELOAD"]:
        del env["LD_PRELOAD"]
    env["PARALLM_NO_OPENBLAS"] = "1"
    cmd = [sys.executable, "-m", "perf.bench_engine", "--no-openblas", "--only", "refblas",
           "--repeats", str(args.ref_repeats)]
    log(f"reference BLAS child: {shlex.join(cmd)}")
    return _run_child(cmd, env)


def _run_child(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": f"child exited {proc.returncode}"}
    res = json.loads(proc.stdout)
    res["command"] = shlex.join(cmd)
    return res


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short workloads, one repeat (a smoke test)")
    add_results_options(parser)
    parser.add_argument("--no-openblas", action="store_true",
                        help="do not preload OpenBLAS (MLX's reference BLAS; ~50x slower matmuls)")
    parser.add_argument("--only", choices=["a", "b", "c", "d", "refblas"], action="append",
                        help="run only these sections ('refblas': the tiny float32 workload, JSON on stdout)")
    parser.add_argument("--repeats", type=int, help="repeats per point (default 3, --quick 1)")
    parser.add_argument("--dtype-batches", type=int, nargs="+", default=[1, 16],
                        help="batch sizes of the float32 vs quantized comparison (section d)")
    parser.add_argument("--dtype-tokens", type=int, help="output tokens in section d (default 8, --quick 4)")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OPENBLAS_NUM_THREADS for the preloaded OpenBLAS; 0 = OpenBLAS's default of one "
                             "thread per core, which collapses when the cores are shared)")
    args = parser.parse_args(argv)
    if not args.no_openblas:
        if not blas.is_preloaded():
            # 0: OpenBLAS's own default, one thread per core (set explicitly: parallm.blas would
            # otherwise choose half the cores)
            os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads or os.cpu_count() or 1)
        blas.reexec_with_openblas()  # no-op once done, or where it does not apply

    quick = args.quick
    args.repeats = args.repeats or (1 if quick else 3)
    args.switch_repeats = 1
    args.dtype_repeats = 1
    args.ref_repeats = 1
    args.batches = [1, 8] if quick else [1, 8, 32]
    args.switch_batches = [8] if quick else [8, 32]
    args.prompt_tokens = 32
    args.max_tokens = 16 if quick else 64
    args.switch_tokens = 16 if quick else 32
    args.dtype_tokens = args.dtype_tokens or (4 if quick else 8)
    args.dtype_prompt_tokens = 8
    args.prefix_tokens = 1000
    args.suffix_tokens = 16
    sections = args.only or ["a", "b", "c", "d"]

    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer

    lm = load_model(ModelConfig(dtype="float32"))
    P = Prompts(load_tokenizer(lm.source))

    if sections == ["refblas"]:
        res = tiny_workload(lm, P, args.repeats)
        res["blas"] = blas_description()
        res["openblas_num_threads"] = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
        json.dump(res, sys.stdout)
        return 0

    files = Results.from_args("engine", args, argv)
    command = files.command
    previous = files.previous() if args.only else {}  # a partial run updates its sections of the last file
    results: dict[str, Any] = {
        **previous,
        "command": command,
        "machine": files.machine,
        "model": {"spec": "default", "name": lm.source.name, "dtype": lm.dtype, "path": str(lm.source.path)},
        "params": {k: v for k, v in vars(args).items() if k not in ("out_dir", "only", "no_openblas")},
        "kv_budget_bytes": KV_BUDGET,
        "loadavg_start": loadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    log(f"{blas_description()}; sections {sections}")
    if "a" in sections:
        results["a_throughput"] = section_a(lm, P, args)
    if "b" in sections:
        results["b_switches"] = section_b(lm, P, args)
    if "c" in sections:
        results["c_prefix"] = section_c(lm, P, args)
    if "d" in sections:
        if blas.is_preloaded():
            results["d_dtype_blas"] = section_d(lm, P, args)
        else:
            results["d_no_openblas_tiny"] = tiny_workload(lm, P, args.repeats)
    results["loadavg_end"] = loadavg()
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    runs = previous.get("runs", [])
    runs.append({"command": command, "sections": sections, "started": results["started"],
                 "finished": results["finished"], "loadavg_start": results["loadavg_start"],
                 "loadavg_end": results["loadavg_end"], "params": results["params"]})
    results["runs"] = runs

    files.write(results, None if "d_no_openblas_tiny" in results else markdown(results))
    if "d_no_openblas_tiny" not in results:
        plot(results, files.png)
    log(f"wrote {files.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
