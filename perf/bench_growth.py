"""How the live KV buffer grows under a burst of arrivals: the row-growth policy before and after
issue 19's fix, in one run, interleaved.

The H200 run of the Qwen3-30B-A3B-shaped MoE at 256 concurrent streams (perf/results/
git show 7a49aa5:perf/results/serving-qwen3-30b-a3b-h200.md) stalled for ~7 s at a time. The engine grew its dense live buffer
four rows at a time as the burst was admitted, and every grow allocates a new buffer of a new size
and copies the old one, which MLX keeps in its buffer cache. This benchmark drives the in-process
engine (a tiny random-weight MoE with the default tokenizer's vocabulary) through the same burst
with the same live-buffer geometry (`--slots`: the H200 run's 65,541 live token slots, so rows x
capacity hit the same limits) and counts the resizes and the token slots they allocated, which at
the MoE's 98,304 bytes a token (48 layers x K,V x 4 heads x 128 x bf16) is what the GPU's buffer
cache had to take:

- `base`: rows grown to the next multiple of 4 (KVBudget.shape_for before the fix);
- `demand`: rows grown by at least half, and at once to the rows the queue wants (the fix).

GPU-like settings: overlap on, no fast-math (so no mixed passes), a 512-token prefill budget.

    python -m perf.bench_growth            # -> perf/results/growth-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from perf.harness import Results, add_results_options, describe

MOE_BYTES_PER_TOKEN = 48 * 2 * 4 * 128 * 2
H200_LIVE_SLOTS = 65_541  # 8 GiB auto budget, a quarter for the prefix pool: the H200 run's live token slots


def base_shape_for(self, rows: int, cap: int, current: tuple[int, int], demand: int = 0):
    """KVBudget.shape_for before issue 19's fix: rows grown to the next quantum."""
    from parallm.engine.plan import round_up

    r0, c0 = current
    if rows > self.max_rows or cap > self.max_len:
        return None
    if rows <= r0 and cap <= c0:
        return current
    grown_r = r0 if rows <= r0 else min(self.max_rows, round_up(rows, self.row_quantum))
    grown_c = c0 if cap <= c0 else min(self.max_len, round_up(max(cap, c0 + c0 // 4), self.cap_quantum))
    tight_r = min(self.max_rows, round_up(rows, self.row_quantum))
    for r in dict.fromkeys((grown_r, tight_r, rows)):
        if r < rows:
            continue
        c = min(grown_c, self.budget_tokens // r)
        if c >= cap:
            return (r, c)
    return None


def run_once(policy: str, loaded: Any, prompt_ids: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel
    from parallm.engine.plan import KVBudget
    from perf.bench_serving import run_inprocess
    from perf.loadgen import WORKLOADS, Workload

    shape_for = KVBudget.shape_for
    if policy == "base":
        KVBudget.shape_for = base_shape_for
    try:
        probe = Engine(EngineModel.of(loaded), Config(engine=EngineConfig(max_num_seqs=8, kv_budget_mb=64)))
        bpt = probe.runner.live.bytes_per_token
        del probe
        mb = args.slots * bpt / 0.75 / (1 << 20)  # the default prefix_pool_fraction takes a quarter
        engine = Engine(EngineModel.of(loaded), Config(engine=EngineConfig(
            max_num_seqs=args.concurrency, kv_budget_mb=mb, overlap=True, fast_math=False, max_prefill_tokens=512)))
        live = engine.runner.live
        grows: list[tuple[int, int, float]] = []
        resize = live.resize

        def counted(rows: int, capacity: int) -> None:
            t0 = time.perf_counter()
            resize(rows, capacity)
            grows.append((rows, capacity, time.perf_counter() - t0))

        live.resize = counted
        mx.reset_peak_memory()
        w = Workload(**{**WORKLOADS["short"].__dict__, "max_tokens": args.max_tokens, "requests": len(prompt_ids)})
        r = run_inprocess(engine, prompt_ids, w, args.concurrency, [2])
        slots = sum(rows * cap for rows, cap, _ in grows)
        r.update(policy=policy, live_slots=engine.budget.budget_tokens, resizes=len(grows),
                 shapes=[[rows, cap] for rows, cap, _ in grows], resize_slots=slots,
                 resize_ms=round(1000 * sum(t for _, _, t in grows), 1),
                 moe_resize_gb=round(slots * MOE_BYTES_PER_TOKEN / 1e9, 1),
                 preemptions=engine.stats().preemptions, peak_mib=round(mx.get_peak_memory() / (1 << 20), 1),
                 cache_mib=round(mx.get_cache_memory() / (1 << 20), 1))
        del engine
        mx.clear_cache()
        return r
    finally:
        KVBudget.shape_for = shape_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="base/demand pairs, interleaved")
    parser.add_argument("--slots", type=int, default=H200_LIVE_SLOTS, help="live token slots of the KV budget")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer files (default: the default model's)")
    parser.add_argument("--work-dir", default="")
    add_results_options(parser)
    args = parser.parse_args(argv)

    from parallm import blas

    blas.reexec_with_openblas()
    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer
    from perf.bench_serving import chat_ids, prompt_seed, shape_model_dir
    from perf.loadgen import WORKLOADS, Workload, make_prompts

    args.shape = "tiny-moe"
    loaded = load_model(ModelConfig(path=str(shape_model_dir(args))))
    tokenizer = load_tokenizer(loaded.source)
    w = Workload(**{**WORKLOADS["short"].__dict__, "requests": args.concurrency})
    prompt_ids = chat_ids(tokenizer, make_prompts(w, prompt_seed(args.concurrency, "http")))
    results = Results.from_args("growth", args, argv)
    runs = []
    for _ in range(args.rounds):
        for policy in ("base", "demand"):
            runs.append(run_once(policy, loaded, prompt_ids, args))
            print({k: runs[-1][k] for k in ("policy", "resizes", "moe_resize_gb", "resize_ms", "throughput_tok_s",
                                            "itl_p99_s")}, flush=True)
    rows = ["| policy | resizes | slots allocated | on the MoE shape | resize ms | tok/s | TTFT p50 s | ITL p50 ms | "
            "ITL p99 ms | preemptions |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(f"| {r['policy']} | {r['resizes']} | {r['resize_slots']:,} | {r['moe_resize_gb']} GB | "
                    f"{r['resize_ms']} | {r['throughput_tok_s']:.1f} | {r['ttft_p50_s']:.2f} | "
                    f"{1000 * r['itl_p50_s']:.0f} | {1000 * r['itl_p99_s']:.0f} | {r['preemptions']} |")
    md = [f"# Live KV buffer growth under a burst of {args.concurrency} arrivals (tiny MoE, {args.slots:,} live "
          f"slots, {args.max_tokens} output tokens)", "", f"Machine: {describe(results.machine)}", "",
          f"Command: `{results.command}`", "", *rows, "",
          "'on the MoE shape': the slots the resizes allocated at the Qwen3-30B-A3B shape's "
          f"{MOE_BYTES_PER_TOKEN:,} bytes a token (each grow allocates a buffer of a new size; MLX caches the old one)."]
    results.write({"concurrency": args.concurrency, "max_tokens": args.max_tokens, "slots": args.slots,
                   "runs": runs}, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
