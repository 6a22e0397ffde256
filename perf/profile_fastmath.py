"""What parallm.engine.fastmath saves on MLX's CPU backend: kernels, then whole engine passes.

Times mlx-lm's stock SwiGLU and attention against the libm-free ones at the default model's
prefill (5 prompts x 45 tokens) and decode (16 rows) shapes, then the engine's prefill pass and
batch-16 decode step on the default model with `engine.fast_math` off and on, alternating.

    python -m perf.profile_fastmath   # -> perf/results/fastmath-cpu.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Callable

from perf.harness import Results, add_results_options


def median_ms(fn: Callable[[], Any], repeats: int = 15) -> float:
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def kernels() -> list[dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm.models import activations, base

    from parallm.engine import fastmath

    rows = []
    for label, m in (("prefill 5x45", 225), ("decode 16", 16)):
        gate, x = mx.random.normal((m, 1536)) * 4, mx.random.normal((m, 1536))
        mx.eval(gate, x)
        rows.append({"kernel": "swiglu", "shape": f"{label} (x 1536)",
                     "stock_ms": median_ms(lambda: activations.swiglu(gate, x)),
                     "fast_ms": median_ms(lambda: fastmath.swiglu(gate, x))})
    for label, (B, L, T) in (("prefill 5x45", (5, 45, 80)), ("decode 16", (16, 1, 150))):
        q, k, v = mx.random.normal((B, 9, L, 64)), mx.random.normal((B, 3, T, 64)), mx.random.normal((B, 3, T, 64))
        mask = (mx.arange(T)[None, None] <= (mx.arange(T - L, T)[None, :, None]))[:, None]
        mask = mx.broadcast_to(mask, (B, 1, L, T))
        mx.eval(q, k, v, mask)
        rows.append({"kernel": "attention", "shape": f"{label} (span {T})",
                     "stock_ms": median_ms(lambda: base.scaled_dot_product_attention(q, k, v, None, 0.125, mask)),
                     "fast_ms": median_ms(lambda: fastmath.scaled_dot_product_attention(q, k, v, None, 0.125, mask))})
    return rows


def engine_steps(rounds: int = 20) -> dict[str, dict[str, float]]:
    """Median step times with `engine.fast_math` off and on, alternating step by step on one
    engine (this VM's speed drifts by 10 % over minutes, so sequential runs mislead): a prefill
    pass of five 45-token prompts (max_tokens 1: the pass alone), then batch-16 decode steps.
    Mixed passes are off: they need fast math (their per-token positions go through its RoPE),
    and a pass must be either kind to be timed as one."""
    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.models import load_model
    from parallm.protocol import SamplingParams

    loaded = load_model(ModelConfig())
    engine = Engine(EngineModel(loaded.model, (), loaded.max_model_len, loaded.vocab_size), Config(engine=EngineConfig(
        max_num_seqs=16, prefix_cache=False, fast_math=True, mixed_passes=False, max_prefill_tokens=225)))
    engine.warm_up()
    fast = engine.runner.fast_math
    rng = random.Random(0)
    times: dict[str, dict[bool, list[float]]] = {"prefill": {True: [], False: []}, "decode": {True: [], False: []}}

    def timed(kind: str, on: bool) -> None:
        engine.runner.fast_math = fast if on else None
        t0 = time.perf_counter()
        engine.step()
        times[kind][on].append(time.perf_counter() - t0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(45)]

    for r in range(2 * rounds):
        for i in range(5):
            engine.add_request(make_request(rid=f"p{r}-{i}", prompt_ids=prompt(),
                                       params=SamplingParams(max_tokens=1, temperature=0.0)))
        timed("prefill", r % 2 == 0)
    params = SamplingParams(max_tokens=4 * rounds + 8, temperature=0.0, ignore_eos=True)
    for i in range(16):
        engine.add_request(make_request(rid=f"d{i}", prompt_ids=prompt(), params=params))
    while engine.stats().running < 16:
        engine.step()
    for r in range(4 * rounds):
        timed("decode", r % 2 == 0)
    engine.runner.fast_math = fast
    return {name: {f"{kind}_step_ms": 1000 * statistics.median(times[kind][on]) for kind in times}
            for name, on in (("stock", False), ("fast_math", True))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_options(parser)
    args = parser.parse_args(argv)
    from parallm import blas

    blas.reexec_with_openblas()
    result = {"kernels": kernels(), "engine": engine_steps()}
    for row in result["kernels"]:
        print(f"{row['kernel']:9} {row['shape']:28} stock {row['stock_ms']:7.3f} ms  fast {row['fast_ms']:7.3f} ms")
    for name, r in result["engine"].items():
        print(f"engine {name:9}: prefill step {r['prefill_step_ms']:6.1f} ms, decode step (16 rows) "
              f"{r['decode_step_ms']:6.1f} ms")
    Results.from_args("fastmath", args, argv).write(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
