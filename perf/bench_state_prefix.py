"""Prefix reuse for models with recurrent state (issue 19): what a state snapshot costs, what a hit saves.

The engine serves hybrid models (gated delta-net + attention: Qwen3-Next, Qwen3.5; Mamba2, ...)
without the prefix cache: the KV blocks of a prefix do not hold the recurrent state after it, so
reusing a prefix needs a snapshot of that state too. This measures the two sides:

1. Bytes (`--shapes`): per sequence, the recurrent state (what a snapshot copies) against the KV
   bytes per token and per prefix-cache block, for real model shapes. The per-layer sizes come from
   mlx-lm's own classes: the shape is built with its real per-layer dimensions but one period of
   layers (one full-attention layer and its linear-attention ones), few experts and a small
   vocabulary, a prompt runs through `make_cache()`, and the caches are read; the totals scale
   those by the real layer counts.
2. Time (`--ttft-shape`): on mlx-lm's own model and caches, the first token of prefix + suffix
   computed cold against a hit that restores a snapshot taken after the prefix (the state arrays and
   the prefix's KV, copied as an engine would copy them into a row) and prefills only the suffix.
   The hit's first token must equal the cold one (the snapshot is exact).

    python -m perf.bench_state_prefix                                   # CPU: bytes + a small hybrid's TTFT
    python -m perf.bench_state_prefix --ttft-shape qwen3.5-4b-hybrid --prefixes 512,2048,8192   # on a GPU

Results: perf/results/state-prefix-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from perf.bench_gpu import SHAPES as GPU_SHAPES
from perf.harness import Results, add_results_options

BLOCK = 16  # engine.block_size unset on a GPU (the CPU's 32): tokens per prefix-cache block

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-Next-80B-A3B's published config.json (the dims that size the caches are what matter here)
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, intermediate_size=5120,
                               num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_value_heads=32,
                               linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=512,
                               num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
                               vocab_size=151936, rope_theta=10000000.0, partial_rotary_factor=0.25,
                               max_position_embeddings=262144, tie_word_embeddings=False, dtype="bfloat16"),
    "qwen3.5-4b-hybrid": GPU_SHAPES["qwen3.5-4b-hybrid"],
    # a small hybrid of the Qwen3.5 kind whose prefill takes seconds, not minutes, on two CPU cores
    "cpu-hybrid": dict(model_type="qwen3_5", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_value_heads=8,
                       linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                       linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6, vocab_size=32000,
                       tie_word_embeddings=True, max_position_embeddings=32768,
                       rope_parameters={"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                       dtype="float32"),
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def build(spec: dict[str, Any], *, layers: int | None = None, small: bool = False):
    """mlx-lm's model of `spec` (random weights) in the shape's dtype; `layers` replaces the layer count,
    `small` shrinks what does not size the caches (vocabulary, experts)."""
    from mlx_lm.utils import _get_classes

    config = {k: v for k, v in spec.items() if k not in ("dtype", "quantize_bits")}
    if layers is not None:
        config["num_hidden_layers"] = layers
    if small:
        config["vocab_size"] = 1024
        for key in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"):
            if key in config:
                config[key] = min(config[key], 64 if key != "num_experts" else 4)
        if "num_experts_per_tok" in config:
            config["num_experts_per_tok"] = min(config["num_experts_per_tok"], 2)
        if "mlp_only_layers" in config:  # dense MLPs: MLX's CPU gather_mm runs float32 only
            config["mlp_only_layers"] = list(range(config["num_hidden_layers"]))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(DTYPES[spec.get("dtype", "float32")])
    mx.eval(model.parameters())
    return model


def cache_bytes(spec: dict[str, Any], tokens: int = 32) -> dict[str, Any]:
    """Per-sequence state bytes and KV bytes per token of the full shape, read from one period of layers."""
    period = int(spec.get("full_attention_interval", 1))
    model = build(spec, layers=period, small=True)
    cache = model.make_cache()
    mx.eval(model(mx.array([[(7 * i + 3) % 1000 for i in range(tokens)]]), cache=cache))
    state = kv_per_token = 0
    state_layers = kv_layers = 0
    for c in cache:
        if isinstance(c, ArraysCache):
            state += sum(a.nbytes for a in c.cache if a is not None)
            state_layers += 1
        elif isinstance(c, KVCache):
            kv_per_token += (c.keys[..., :c.offset, :].nbytes + c.values[..., :c.offset, :].nbytes) // c.offset
            kv_layers += 1
        else:
            raise ValueError(f"{type(c).__name__}: not a cache this measures")
    total = int(spec["num_hidden_layers"])
    n_kv = total // period if period > 1 else (total if kv_layers else 0)
    n_state = total - n_kv
    per_seq_state = state // max(1, state_layers) * n_state
    per_token_kv = kv_per_token // max(1, kv_layers) * n_kv
    return {"layers": total, "state_layers": n_state, "attention_layers": n_kv,
            "state_bytes_per_sequence": per_seq_state, "kv_bytes_per_token": per_token_kv,
            "kv_bytes_per_block": per_token_kv * BLOCK,
            "state_over_block": per_seq_state / max(1, per_token_kv * BLOCK),
            "kv_tokens_per_snapshot": per_seq_state / max(1, per_token_kv)}


def _copy(a: mx.array) -> mx.array:
    return mx.array(a) + mx.zeros((), a.dtype)  # a real copy, as a restore writes a row


def _arrays(cache) -> list[mx.array]:
    return [a for c in cache for a in (c.cache if isinstance(c, ArraysCache) else (c.keys, c.values)) if a is not None]


def _prefill(model, tokens: list[int], cache) -> int:
    logits = model(mx.array([tokens]), cache=cache)
    first = mx.argmax(logits[0, -1])
    mx.eval(first, _arrays(cache))
    return int(first.item())


def ttft(model, vocab: int, prefix: int, suffix: int, repeats: int) -> dict[str, Any]:
    """Cold first token of prefix + suffix vs a hit restoring the snapshot after the prefix (medians)."""
    prompt = [(104729 * i + 7) % min(vocab, 30000) for i in range(prefix + suffix)]
    snap = model.make_cache()
    _prefill(model, prompt[:prefix], snap)
    saved = [[None if a is None else _copy(a) for a in c.cache] if isinstance(c, ArraysCache)
             else [_copy(c.keys[..., :c.offset, :]), _copy(c.values[..., :c.offset, :])] for c in snap]
    mx.eval([a for entry in saved for a in entry if a is not None])
    snapshot_bytes = sum(a.nbytes for entry, c in zip(saved, snap) if isinstance(c, ArraysCache)
                         for a in entry if a is not None)
    cold_ms, hit_ms, restore_ms = [], [], []
    firsts = set()
    _prefill(model, prompt[prefix:], model.make_cache())  # warm-up: the first call of a shape compiles kernels
    for _ in range(repeats):
        t0 = time.perf_counter()
        firsts.add(("cold", _prefill(model, prompt, model.make_cache())))
        cold_ms.append(1000 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        cache = model.make_cache()
        for c, entry in zip(cache, saved):
            if isinstance(c, ArraysCache):
                c.cache = [None if a is None else _copy(a) for a in entry]
            else:
                c.keys, c.values, c.offset = _copy(entry[0]), _copy(entry[1]), prefix
        mx.eval(_arrays(cache))
        restore_ms.append(1000 * (time.perf_counter() - t0))
        firsts.add(("hit", _prefill(model, prompt[prefix:], cache)))
        hit_ms.append(1000 * (time.perf_counter() - t0))
    same = len({tok for _, tok in firsts}) == 1
    cold, hit = statistics.median(cold_ms), statistics.median(hit_ms)
    return {"prefix": prefix, "suffix": suffix, "cold_ttft_ms": round(cold, 2), "hit_ttft_ms": round(hit, 2),
            "restore_ms": round(statistics.median(restore_ms), 3), "saved_ms": round(cold - hit, 2),
            "hit_over_cold": round(hit / cold, 4), "snapshot_state_bytes": snapshot_bytes,
            "same_first_token": same}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Prefix reuse for hybrid models: state snapshot vs KV", "", f"`{data['command']}`", "",
             f"Block = {BLOCK} tokens. One snapshot holds every state layer of one sequence at one position.", "",
             "| shape | layers (state / attention) | state per sequence | KV per token | KV per block | "
             "state / block | KV tokens one snapshot would hold |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, b in data["bytes"].items():
        lines.append(f"| {name} | {b['state_layers']} / {b['attention_layers']} "
                     f"| {_mib(b['state_bytes_per_sequence'])} | {_mib(b['kv_bytes_per_token'])} "
                     f"| {_mib(b['kv_bytes_per_block'])} | {b['state_over_block']:.0f}x "
                     f"| {b['kv_tokens_per_snapshot']:.0f} |")
    t = data.get("ttft")
    if t:
        lines += ["", f"TTFT on `{t['shape']}` (mlx-lm's model and caches, median of {t['repeats']}; a hit restores "
                  "the snapshot and prefills the suffix):", "",
                  "| prefix + suffix | cold TTFT | hit TTFT | hit/cold | saved | restore | same first token |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in t["runs"]:
            lines.append(f"| {r['prefix']} + {r['suffix']} | {r['cold_ttft_ms']:.1f} ms | {r['hit_ttft_ms']:.1f} ms "
                         f"| {r['hit_over_cold']:.3f} | {r['saved_ms']:.1f} ms | {r['restore_ms']:.2f} ms "
                         f"| {r['same_first_token']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-next-80b-a3b,qwen3.5-4b-hybrid,cpu-hybrid",
                        help="shapes whose cache bytes are computed (%(default)s)")
    parser.add_argument("--ttft-shape", default="cpu-hybrid", help="shape whose TTFT is measured ('' for none)")
    parser.add_argument("--prefixes", default="256,1024", help="shared prefix lengths (%(default)s)")
    parser.add_argument("--suffix", type=int, default=16, help="new tokens after the prefix (%(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("state-prefix", args, argv)
    data: dict[str, Any] = {"bytes": {}}
    for name in filter(None, args.shapes.split(",")):
        data["bytes"][name] = cache_bytes(SHAPES[name])
        print(name, data["bytes"][name], flush=True)
    if args.ttft_shape:
        model = build(SHAPES[args.ttft_shape])
        runs = []
        for prefix in (int(p) for p in args.prefixes.split(",")):
            runs.append(ttft(model, int(SHAPES[args.ttft_shape]["vocab_size"]), prefix, args.suffix, args.repeats))
            print(runs[-1], flush=True)
        data["ttft"] = {"shape": args.ttft_shape, "repeats": args.repeats, "runs": runs}
    path = results.write(data, None)
    data["command"] = results.command
    results.md.write_text(markdown(data))
    print(f"wrote {path}")
    return 0 if all(r["same_first_token"] for r in data.get("ttft", {}).get("runs", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
