"""Throughput on a GPU (MLX CUDA or Metal) with random-weight models of real shapes.

No hub is reachable on the lent GPU machine, so the model is built from its shape with random
weights (what decode throughput depends on), saved as an mlx-lm model directory with a borrowed
tokenizer, and measured four ways on the same weights in one run:

- `batchgen`: mlx-lm's in-process BatchGenerator (the engine ceiling users compare with);
- `engine`: parallm's in-process Engine;
- `served`: parallm-launch over the raw ZeroMQ client (token ids in and out; the model's vocabulary
  is larger than the borrowed tokenizer's, so no text is decoded);
- the memory-bandwidth limit for one decode stream (weight bytes / HBM bandwidth).

    python -m perf.bench_gpu --shape llama-3.2-3b --concurrency 1,256 --tokenizer-dir DIR   # -> perf/results/gpu-llama-3.2-3b-h100.json
    python -m perf.bench_gpu --shape tiny --concurrency 1,4 --tokenizer-dir DIR --out-dir /tmp   # a smoke run on CPU

The results file is named after the shape unless --experiment names the run otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec
from mlx.utils import tree_flatten

from parallm.models.shapes import SHAPES, build_model_dir  # noqa: F401 (re-exported: the perf scripts import them here)
from perf.harness import Results, Server, add_results_options

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def weight_bytes(model: nn.Module) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


# ---------------------------------------------------------------------------- in-process

def run_batchgen(model: nn.Module, batch: list[list[int]], max_tokens: int) -> dict[str, float]:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[], completion_batch_size=len(batch),
                         prefill_batch_size=min(len(batch), 32))
    start = time.perf_counter()
    gen.insert(batch, [max_tokens] * len(batch))
    tokens = 0
    decode_start = None
    decode_tokens = 0
    while True:
        _, generated = gen.next()
        if not generated and not gen._unprocessed_sequences and not gen._currently_processing \
                and tokens >= len(batch) * max_tokens:
            break
        if generated:
            if decode_start is None and len(generated) == len(batch):
                decode_start = time.perf_counter()
            elif decode_start is not None:
                decode_tokens += len(generated)
            tokens += len(generated)
        if tokens >= len(batch) * max_tokens:
            break
    end = time.perf_counter()
    gen.close()
    return {"tok_s": tokens / (end - start),
            "decode_tok_s": decode_tokens / (end - decode_start) if decode_start and end > decode_start else 0.0}


KV_BUDGET_MB = 24_000


def run_engine(model: nn.Module, batch: list[list[int]], max_tokens: int, max_len: int) -> dict[str, float]:
    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.protocol import SamplingParams

    engine = Engine(EngineModel(model, (), max_len), Config(engine=EngineConfig(max_num_seqs=max(len(batch), 1), max_prefill_tokens=8192, max_prefill_rows=64, kv_budget_mb=KV_BUDGET_MB)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        engine.add_request(make_request(rid=str(i), prompt_ids=ids, params=params))
    tokens = decode_tokens = 0
    decode_start = None
    while engine.has_work():
        outs = engine.step()
        n = sum(len(o.token_ids) for o in outs)
        if decode_start is None and len(outs) == len(batch):
            decode_start = time.perf_counter()
        elif decode_start is not None:
            decode_tokens += n
        tokens += n
    end = time.perf_counter()
    stats = engine.stats()
    return {"tok_s": tokens / (end - start),
            "decode_tok_s": decode_tokens / (end - decode_start) if decode_start and end > decode_start else 0.0,
            "step_ms_mean": stats.step_ms_mean, "steps": stats.steps}


# ---------------------------------------------------------------------------- served

async def served_run(router: str, batch: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, float]:
    from parallm.client import AsyncClient
    from parallm.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    tokens = 0
    async with AsyncClient(router, timeout=1800) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(ids: list[int]) -> None:
            nonlocal tokens
            async with sem:
                t0 = time.perf_counter()
                first = True
                async for out in client.stream(ids, params):
                    if out.token_ids and first:
                        ttfts.append(time.perf_counter() - t0)
                        first = False
                    tokens += len(out.token_ids) // 4

        start = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in batch))
        wall = time.perf_counter() - start
    ttfts.sort()
    return {"tok_s": tokens / wall, "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else float("nan")}


async def engine_stats(router: str) -> dict[str, Any]:
    from parallm.client import AsyncClient

    async with AsyncClient(router, timeout=60) as client:
        return msgspec.to_builtins(await client.stats())


def delta_of(before: dict[str, Any], after: dict[str, Any], key: str, steps_key: str) -> dict[str, float]:
    """Per-step means of `key` over the steps between two snapshots."""
    n0, n1 = before.get(steps_key, 0), after.get(steps_key, 0)
    if n1 <= n0:
        return {}
    return {k: round((v * n1 - before.get(key, {}).get(k, 0.0) * n0) / (n1 - n0), 4)
            for k, v in after.get(key, {}).items()}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The served engine's per-step means over the steps between two stats snapshots: its own
    phases (`step_ms_mean`, as the in-process engine reports them) and the stage loop's split
    (`stage_ms_mean`: inbox, step, send, beat)."""
    def delta(key: str, steps_key: str) -> dict[str, float]:
        return delta_of(before, after, key, steps_key)

    return {"steps": after.get("steps", 0) - before.get("steps", 0),
            "step_ms_mean": delta("step_ms_mean", "steps"),
            "stage_ms_mean": delta_of(before.get("loop", {}), after.get("loop", {}), "ms_mean", "steps")}


def served(model_dir: Path, max_seqs: int, extra: list[str] | None = None, kv_budget_mb: int = KV_BUDGET_MB) -> Server:
    """parallm-launch on `model_dir` with the in-process engine's settings, started."""
    return Server("--model", str(model_dir), "--engine.max-num-seqs", str(max_seqs),
                  "--engine.max-prefill-tokens", "8192", "--engine.max-prefill-rows", "64",
                  "--engine.kv-budget-mb", str(kv_budget_mb), "--supervisor.stall-after-s", "0", *(extra or []),
                  ready_timeout=900).start()


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tokenizer-dir", type=Path, required=True, help="a directory with tokenizer.json etc.")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "parallm-bench-gpu")
    parser.add_argument("--targets", default="batchgen,engine,served")
    parser.add_argument("--warm-tokens", type=int, default=0,
                        help="output tokens of each level's warm-up run (0: --max-tokens); fewer fit a long "
                             "level into one call")
    add_results_options(parser, default_help="the shape")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    warm_tokens = args.warm_tokens or args.max_tokens
    targets = args.targets.split(",")

    from mlx_lm.utils import load_model

    t0 = time.perf_counter()
    model_dir = build_model_dir(args.shape, args.work_dir / args.shape, args.tokenizer_dir)
    build_s = time.perf_counter() - t0
    gc.collect()
    mx.clear_cache()
    results = Results.from_args("gpu", args, argv, experiment=args.shape)
    bandwidth = next((v for k, v in HBM_BYTES_PER_S.items() if k in results.machine["gpu"]), 0.0)
    result: dict[str, Any] = {
        "shape": args.shape, "spec": SHAPES[args.shape], "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "model_build_s": build_s, "runs": []}
    max_len = args.prompt_len + args.max_tokens + 16

    def record(entry: dict[str, Any]) -> None:
        result["runs"].append(entry)
        print(json.dumps(entry), flush=True)
        results.write(result)

    if "served" in targets:  # first, while this process holds no device memory
        server = served(model_dir, max(levels))
        try:
            asyncio.run(served_run(server.router, prompts(2, 16, 99), 4, 2))
            for c in levels:
                batch = prompts(c, args.prompt_len, c)
                asyncio.run(served_run(server.router, batch, warm_tokens, c))  # warm: kernels for these shapes
                before = asyncio.run(engine_stats(server.router))
                entry = asyncio.run(served_run(server.router, prompts(c, args.prompt_len, c + 1), args.max_tokens, c))
                record({"target": "served", "concurrency": c, **entry,
                        **stats_delta(before, asyncio.run(engine_stats(server.router)))})
        finally:
            server.stop()

    model, _ = load_model(model_dir)
    mx.eval(model.parameters())
    wbytes = weight_bytes(model)
    result["weight_bytes"] = wbytes
    result["bandwidth_limit_single_stream_tok_s"] = bandwidth / wbytes if bandwidth else None
    run_batchgen(model, prompts(2, 16, 99), 4)  # warm-up: kernels compiled
    run_engine(model, prompts(2, 16, 99), 4, max_len)
    for c in levels:
        warm, batch = prompts(c, args.prompt_len, c), prompts(c, args.prompt_len, c + 1)
        if "batchgen" in targets:
            run_batchgen(model, warm, warm_tokens)
            record({"target": "batchgen", "concurrency": c, **run_batchgen(model, batch, args.max_tokens)})
            gc.collect()
        if "engine" in targets:
            run_engine(model, warm, warm_tokens, max_len)
            record({"target": "engine", "concurrency": c, **run_engine(model, batch, args.max_tokens, max_len)})
            gc.collect()
    ratios = {}
    by = {(r["target"], r["concurrency"]): r["tok_s"] for r in result["runs"]}
    for c in levels:
        base = by.get(("batchgen", c))
        if base:
            ratios[str(c)] = {t: by[(t, c)] / base for t in ("engine", "served") if (t, c) in by}
    result["ratios_vs_batchgen"] = ratios
    results.write(result)
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
