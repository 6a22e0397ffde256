"""How much of a small model's decode pass is launching, and what `mx.compile` of the whole pass saves.

A 16-row decode pass of the default model's shape on MLX CUDA takes 10-14 ms although the GPU
work is well under a millisecond (docs/adapters.md): the pass is spent building the graph in
Python and launching ~500 kernels. This script measures, on random weights of a shape:

- `build_ms`: building the pass's graph in Python (no evaluation);
- `eager_ms`: building and evaluating it, synchronously, step after step;
- `compiled_ms`: the same pass under `mx.compile` (traced once per shape: the KV buffers have a
  fixed capacity, each row writes at its own position and a mask hides the unused tail), so no
  Python runs per step and elementwise chains are fused;
- each with a rank-16 LoRA on q/v (the adapter benchmark's), the LoRA weights passed as inputs
  of the compiled function (a new version must not need a retrace).

    python -m perf.profile_compiled_pass --shape smollm2-135m --tokenizer-dir DIR   # -> perf/results/compiled-pass-h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn


class StaticRows:
    """One layer's KV for a pass at fixed capacity: row r writes its token at positions[r]."""

    def __init__(self, keys: mx.array, values: mx.array, positions: mx.array, mask: mx.array) -> None:
        self.keys, self.values, self.positions, self._mask = keys, values, positions, mask

    @property
    def offset(self) -> mx.array:
        return self.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        idx = mx.broadcast_to(self.positions[:, None, None, None], keys.shape)
        self.keys = mx.put_along_axis(self.keys, idx, keys, axis=2)
        self.values = mx.put_along_axis(self.values, idx, values, axis=2)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self._mask

    def __bool__(self) -> bool:
        return True


class LoRA(nn.Module):
    def __init__(self, linear: nn.Module, slot: dict[str, mx.array]) -> None:
        super().__init__()
        self.linear = linear
        self.slot = slot

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        if "a" not in self.slot:
            return y
        return y + (2.0 * ((x @ self.slot["a"]) @ self.slot["b"])).astype(x.dtype)


def wrap_lora(model: nn.Module) -> list[dict[str, mx.array]]:
    slots = []
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            slot: dict[str, mx.array] = {}
            setattr(layer.self_attn, name, LoRA(getattr(layer.self_attn, name), slot))
            slots.append(slot)
    return slots


def lora_weights(model: nn.Module, rank: int, seed: int) -> list[tuple[mx.array, mx.array]]:
    key = mx.random.key(seed)
    out = []
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            lin = getattr(layer.self_attn, name).linear
            o, i = lin.weight.shape
            ka, kb, key = mx.random.split(key, 3)
            out.append(((mx.random.normal((i, rank), key=ka) * 0.01).astype(mx.bfloat16),
                        (mx.random.normal((rank, o), key=kb) * 0.01).astype(mx.bfloat16)))
    mx.eval(out)
    return out


def make_pass(model: nn.Module, slots: list[dict[str, mx.array]]) -> Callable:
    def forward(tokens, positions, keys, values, lora):
        for slot, ab in zip(slots, lora):
            slot["a"], slot["b"] = ab
        cap = keys[0].shape[2]
        mask = (mx.arange(cap)[None, :] <= positions[:, None])[:, None, None, :]
        caches = [StaticRows(k, v, positions, mask) for k, v in zip(keys, values)]
        logits = model(tokens, cache=caches)
        for slot in slots:
            slot.clear()
        nxt = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.uint32)
        return nxt, [c.keys for c in caches], [c.values for c in caches]

    return forward


def run(fn: Callable, model: nn.Module, rows: int, cap: int, steps: int, lora: list, eval_each: bool = True
        ) -> dict[str, float]:
    args = model.args
    heads = args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = model.model.embed_tokens.weight.dtype
    keys = [mx.zeros((rows, heads, cap, dim), dtype) for _ in model.model.layers]
    values = [mx.zeros((rows, heads, cap, dim), dtype) for _ in model.model.layers]
    tokens = mx.array([[i + 1] for i in range(rows)], dtype=mx.uint32)
    mx.eval(keys, values, tokens)
    times, builds = [], []
    out_tokens = []
    for step in range(steps):
        positions = mx.full((rows,), step, dtype=mx.int32)
        t0 = time.perf_counter()
        nxt, keys, values = fn(tokens, positions, keys, values, lora)
        t1 = time.perf_counter()
        if eval_each:
            mx.eval(nxt, keys, values)
        t2 = time.perf_counter()
        builds.append((t1 - t0) * 1e3)
        times.append((t2 - t0) * 1e3)
        tokens = nxt[:, None]
        out_tokens.append(nxt)
    mx.eval(out_tokens)
    warm = steps // 4
    return {"ms_median": statistics.median(times[warm:]), "build_ms_median": statistics.median(builds[warm:]),
            "first_ms": times[0], "tokens": [t.tolist() for t in out_tokens[:4]]}


def main() -> None:
    from mlx_lm.utils import load_model

    from perf.bench_gpu import build_model_dir
    from perf.harness import Results, add_results_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/bg"))
    p.add_argument("--rows", default="1,16")
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    add_results_options(p)
    a = p.parse_args()

    model, _ = load_model(build_model_dir(a.shape, a.work_dir / a.shape, a.tokenizer_dir))
    slots = wrap_lora(model)
    mx.eval(model.parameters())
    lora = lora_weights(model, 16, 0)
    lora2 = lora_weights(model, 16, 1)
    forward = make_pass(model, slots)
    compiled = mx.compile(forward)
    results = Results.from_args("compiled-pass", a)
    result: dict[str, Any] = {"shape": a.shape, "capacity": a.capacity}
    for rows in [int(r) for r in a.rows.split(",")]:
        for label, weights in (("base", []), ("lora_qv_r16", lora)):
            eager = run(forward, model, rows, a.capacity, a.steps, weights)
            comp = run(compiled, model, rows, a.capacity, a.steps, weights)
            same = eager["tokens"] == comp["tokens"]
            entry = {"eager_ms": eager["ms_median"], "build_ms": eager["build_ms_median"],
                     "compiled_ms": comp["ms_median"], "compiled_first_ms": comp["first_ms"],
                     "compiled_build_ms": comp["build_ms_median"], "same_tokens": same}
            if weights:
                swap = run(compiled, model, rows, a.capacity, 8, lora2)
                entry["compiled_new_weights_first_ms"] = swap["first_ms"]
            result[f"rows{rows}_{label}"] = entry
            print(rows, label, json.dumps(entry), flush=True)
    results.write(result)


if __name__ == "__main__":
    main()
