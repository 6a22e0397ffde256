"""What the engine's recurrent-state views (parallm/engine/state.py) add to a hybrid model's decode
step against mlx-lm's own caches (ArraysCache + KVCache), at batch 1 and 64.

A Qwen3.5-4B-like hybrid (perf/bench_gpu.py's qwen3.5-4b-hybrid: 32 layers, gated delta-net with
full attention every 4th) served at 10.2 ms a token against BatchGenerator's 8.3 at c=1 on the
H200 (git show 7a49aa5:perf/results/serving-qwen3.5-4b-hybrid-h200.md). On a GPU a decode step of a small batch is
bound by kernel launches and graph building, so this counts, for one decode step's logits, the
nodes of MLX's graph (mx.export_to_dot) and the seconds to build it, on a model of that layer
structure with small widths (the counts do not depend on the widths), both ways:

- `mlx-lm`: the model over mlx-lm's prompt cache (every row at the same length);
- `engine`: the model over the engine's views of its live buffers (RowsView, RowsState), the rows
  at the same lengths, in a live buffer of the engine's row quantum.

    python -m perf.profile_state_views          # -> perf/results/state-views-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from perf.harness import Results, add_results_options, describe

STRUCTURE = dict(model_type="qwen3_5", hidden_size=64, num_hidden_layers=32, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                 linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                 full_attention_interval=4, rms_norm_eps=1e-6, vocab_size=1000, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope_parameters={"type": "default", "rope_theta": 10000000.0,
                                                                "partial_rotary_factor": 0.25})


def graph_nodes(arr: Any) -> int:
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r+", suffix=".dot") as f:
        mx.export_to_dot(f.name, arr)
        return sum(1 for line in Path(f.name).read_text().splitlines() if "label" in line and "->" not in line)


def model_of_structure():
    import importlib

    import mlx.core as mx

    arch = importlib.import_module("mlx_lm.models.qwen3_5")
    model = arch.Model(arch.ModelArgs.from_dict(STRUCTURE))
    mx.eval(model.parameters())
    return model


def measure(build, repeats: int) -> dict[str, float]:
    """Graph nodes of one step's logits, and build / evaluate seconds (medians over `repeats`)."""
    import mlx.core as mx

    builds, evals, nodes = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits, state = build()
        t1 = time.perf_counter()
        nodes = graph_nodes(logits)
        t2 = time.perf_counter()
        mx.eval(logits, state)
        evals.append(time.perf_counter() - t2)
        builds.append(t1 - t0)
    builds.sort()
    evals.sort()
    return {"nodes": nodes, "build_ms": round(1000 * builds[len(builds) // 2], 3),
            "eval_ms": round(1000 * evals[len(evals) // 2], 3)}


def mlx_lm_step(model, batch: int, prompt: list[int]):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt] * batch), cache=cache), [c.state for c in cache])
    token = mx.array([[prompt[-1]]] * batch)

    def build():
        return model(token, cache=cache)[:, -1, :], [c.state for c in cache]

    return build


def engine_step(model, batch: int, prompt: list[int]):
    import mlx.core as mx

    from parallm.engine.cache import LiveKV, PassContext
    from parallm.engine.compat import check_model
    from parallm.engine.plan import round_up

    info = check_model(model)
    live = LiveKV(info.shapes, info.dtype, info.layout)
    live.resize(round_up(batch, 4), 128)
    n = len(prompt)
    mx.eval(model(mx.array([prompt] * batch), cache=live.views(PassContext(0, [0] * batch, n, n))), live.arrays())
    token = mx.array([[prompt[-1]]] * batch)

    def build():
        ctx = PassContext(0, [n] * batch, 1, n + 1, mask5d=info.mask5d)
        return model(token, cache=live.views(ctx))[:, -1, :], live.arrays()

    return build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=16)
    add_results_options(parser)
    args = parser.parse_args(argv)
    model = model_of_structure()
    prompt = [(7 * j) % 997 + 1 for j in range(args.prompt_len)]
    results = Results.from_args("state-views", args, argv)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for way, make in (("mlx-lm", mlx_lm_step), ("engine", engine_step)):
            r = {"way": way, "batch": batch, **measure(make(model, batch, prompt), args.repeats)}
            rows.append(r)
            print(r, flush=True)
    table = ["| batch | way | graph nodes | build ms | eval ms |", "|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['way']} | {r['nodes']} | {r['build_ms']} | {r['eval_ms']} |" for r in rows]
    md = ["# One decode step of a Qwen3.5-4B-like hybrid's layer structure: engine views vs mlx-lm's caches", "",
          f"Machine: {describe(results.machine)}", "", f"Command: `{results.command}`", "", *table]
    results.write({"structure": STRUCTURE, "prompt_len": args.prompt_len, "rows": rows}, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
