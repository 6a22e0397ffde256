"""What mixed passes (`engine.mixed_passes`) and the per-pass RoPE tables save on MLX's CPU backend.

1. Passes: the default model's forward over 16 decode rows, over one 45-token prompt, and over
   both packed into one 61-token pass (the weights read once), each the median of `--repeats`.
2. RoPE: `mx.fast.rope` (MLX's CPU fallback) against `FastRoPE` for a batch-16 decode query.
3. Engine steps, alternating step by step on one engine (this VM drifts ~10 % over minutes):
   batch-16 decode steps with the RoPE stand-ins on and off.
4. In-process closed loop, 16 chat streams of 64 tokens (perf.bench_serving's workload, prefix
   cache off so repeated prompts stay cold), `--runs` runs with `mixed_passes` on and off,
   alternating which goes first.

    python -m perf.profile_mixed   # -> perf/results/mixed-passes-cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from perf.harness import Results, add_results_options
from perf.profile_fastmath import median_ms


def passes(engine, repeats: int) -> dict[str, float]:
    """Model passes through the engine's own cache views, with its fast math entered."""
    import mlx.core as mx

    from parallm.engine.cache import LiveKV, PassContext
    from parallm.engine.packed import PackedContext

    runner = engine.runner
    live = LiveKV(runner.info.shapes, runner.info.dtype)
    live.resize(17, 256)
    rng = random.Random(0)
    offsets = [100 + i for i in range(16)]
    decode_tokens = mx.array([rng.randrange(100, 40000) for _ in range(16)])
    prompt = mx.array([rng.randrange(100, 40000) for _ in range(45)])
    last = mx.array([44])

    def decode():
        return runner.call_model(decode_tokens[:, None], live.views(PassContext(0, offsets, 1, 116)))[:, -1]

    def prefill():
        with runner.head.select(last):
            return runner.call_model(prompt[None], live.views(PassContext(16, [0], 45, 45)))

    def packed():
        with runner.head.select(mx.array(list(range(16)) + [60])):
            return runner.call_model(mx.concatenate([decode_tokens, prompt])[None],
                                     live.views(PackedContext(offsets, 16, [0], [45])))

    out = {}
    for _ in range(2):  # the second round is reported (the first builds what MLX caches)
        out = {"decode_16_rows_ms": median_ms(decode, repeats), "prefill_45_tokens_ms": median_ms(prefill, repeats),
               "packed_16_rows_plus_45_tokens_ms": median_ms(packed, repeats)}
    out["separate_sum_ms"] = out["decode_16_rows_ms"] + out["prefill_45_tokens_ms"]
    return out


def rope_kernel(repeats: int) -> dict[str, float]:
    import mlx.core as mx
    import mlx.nn as nn

    from parallm.engine.fastmath import FastRoPE, RopeTables

    rope = nn.RoPE(64, base=100000.0)
    x = mx.random.normal((16, 1, 9, 64)).transpose(0, 2, 1, 3)
    offset = mx.arange(100, 116)
    mx.eval(x, offset)
    tables = RopeTables()
    fast = FastRoPE(rope, tables)
    mx.eval(tables.get(offset, 1, 64, rope.base, rope.scale, None))

    def build() -> tuple:
        tables.clear()
        return tables.get(offset, 1, 64, rope.base, rope.scale, None)

    # a pass builds the tables once and rotates queries and keys in every layer with them
    return {"stock_us": 1000 * median_ms(lambda: rope(x, offset=offset), repeats),
            "fast_rotation_us": 1000 * median_ms(lambda: fast(x, offset=offset), repeats),
            "tables_once_per_pass_us": 1000 * median_ms(build, repeats)}


def rope_steps(engine, rounds: int) -> dict[str, float]:
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    fm = engine.runner.fast_math
    ropes = fm.ropes
    rng = random.Random(1)
    params = SamplingParams(max_tokens=2 * rounds + 40, temperature=0.0, ignore_eos=True)  # outlasts the prefills
    for i in range(16):
        engine.add_request(make_request(rid=f"d{i}", prompt_ids=[rng.randrange(100, 40000) for _ in range(100)],
                                   params=params))
    while engine.stats().running < 16:
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(2 * rounds):
        on = r % 2 == 0
        fm.ropes = ropes if on else []
        t0 = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - t0)
    fm.ropes = ropes
    while engine.has_work():
        engine.step()
    return {"decode_step_rope_tables_ms": 1000 * statistics.median(times[True]),
            "decode_step_stock_rope_ms": 1000 * statistics.median(times[False])}


def closed_loop(loaded, runs: int) -> dict[str, Any]:
    import msgspec

    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_tokenizer
    from perf.bench_serving import chat_ids, run_inprocess
    from perf.loadgen import WORKLOADS, Workload, make_prompts

    tokenizer = load_tokenizer(loaded.source)
    engine = Engine(EngineModel.of(loaded), Config(engine=EngineConfig(max_num_seqs=16, prefix_cache=False)))
    engine.warm_up()
    workload = Workload(**{**WORKLOADS["short"].__dict__, "max_tokens": 64, "requests": 32})
    got: dict[str, dict[str, list[float]]] = {"mixed": {"tok_s": [], "ttft_p50_s": []},
                                              "separate": {"tok_s": [], "ttft_p50_s": []}}
    for run in range(runs):
        for on in ((True, False) if run % 2 == 0 else (False, True)):
            engine.config = msgspec.structs.replace(engine.config, mixed_passes=on)
            r = run_inprocess(engine, chat_ids(tokenizer, make_prompts(workload, 100 + run)), workload, 16, [2])
            g = got["mixed" if on else "separate"]
            g["tok_s"].append(round(r["throughput_tok_s"], 1))
            g["ttft_p50_s"].append(round(r["ttft_p50_s"], 3))
    return {k: {**v, "tok_s_median": statistics.median(v["tok_s"]),
                "ttft_p50_s_median": statistics.median(v["ttft_p50_s"])} for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=40, help="decode steps each way, alternating")
    parser.add_argument("--runs", type=int, default=6, help="closed-loop runs each way")
    add_results_options(parser)
    args = parser.parse_args(argv)
    from parallm import blas

    blas.reexec_with_openblas()
    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model
    loaded = load_model(ModelConfig())
    engine = Engine(EngineModel(loaded.model, (), loaded.max_model_len, loaded.vocab_size), Config(engine=EngineConfig(max_num_seqs=16, prefix_cache=False)))
    engine.warm_up()
    result = {"passes": passes(engine, args.repeats), "rope_kernel": rope_kernel(args.repeats),
              "rope_steps": rope_steps(engine, args.rounds)}
    del engine
    print(json.dumps({k: result[k] for k in ("passes", "rope_kernel", "rope_steps")}, indent=1), flush=True)
    result["closed_loop_c16"] = closed_loop(loaded, args.runs)
    print(json.dumps(result["closed_loop_c16"], indent=1))
    Results.from_args("mixed-passes", args, argv).write(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
