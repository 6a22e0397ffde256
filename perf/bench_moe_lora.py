"""LoRA on MoE experts: what expert adapters cost the engine's decode (issue 19).

In-process Engine on a random-weight MoE of a perf.bench_gpu shape (the GPU machine has no model
files), greedy decode of `rows` rows, four ways on the same weights:

- `base`: no adapter loaded (mlx-lm's own MoE blocks);
- `loaded`: expert adapters loaded, every row on the base model (the swapped blocks' no-adapter path);
- `single`: every row under one adapter (mlx-lm's LoRASwitchLinear computation per projection);
- `mixed`: rows spread over two adapters and the base model (the slot-major stacks, slot*E + expert).

Each adapter is rank `--rank` on every expert projection (gate, up, down) of every layer, as
mlx-lm's trainer writes it (LoRASwitchLinear: lora_a [E, r, in], lora_b [E, out, r]).

    python -m perf.bench_moe_lora                                        # CPU: the tiny MoE
    python -m perf.bench_moe_lora --shape qwen3-30b-a3b --rows 64,256 --tokenizer-dir DIR   # a GPU

Results: perf/results/moe-lora[-<shape>]-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from parallm.adapters import save_bytes
from parallm.adapters.switch_lora import SWITCH_LINEARS, switch_dims
from parallm.config import Config, EngineConfig
from parallm.engine import Engine, EngineModel, make_request
from parallm.protocol import SamplingParams
from perf.bench_gpu import KV_BUDGET_MB, SHAPES, build_model_dir
from perf.harness import Results, add_results_options


def expert_lora(model, rank: int, seed: int) -> tuple[dict, bytes]:
    """An mlx-lm-format adapter on every expert projection, small random values, the model's dtype."""
    mx.random.seed(seed)
    tensors = {}
    for path, module in model.named_modules():
        if isinstance(module, SWITCH_LINEARS):
            experts, d_in, d_out = switch_dims(module)
            dtype = module.scales.dtype if hasattr(module, "scales") else module.weight.dtype
            tensors[f"{path}.lora_a"] = (mx.random.normal((experts, rank, d_in)) * d_in ** -0.5).astype(dtype)
            tensors[f"{path}.lora_b"] = (mx.random.normal((experts, d_out, rank)) * 0.02).astype(dtype)
    if not tensors:
        raise SystemExit("the shape has no expert (switch) layers")
    config = {"fine_tune_type": "lora", "num_layers": -1,
              "lora_parameters": {"rank": rank, "scale": 2.0, "dropout": 0.0}}
    return config, save_bytes(tensors)


def decode_tok_s(engine: Engine, adapters: list[str], rows: int, tokens: int, tag: str) -> float:
    """Decode tokens/s of `rows` greedy rows, row i under adapters[i % len] ("" = the base model)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for rnd, p in (("w", warm), ("", params)):
        for i in range(rows):
            engine.add_request(make_request(rid=f"{tag}{rnd}{i}", prompt_ids=[1, 504 + i, 3458, 282, 2 + i % 50],
                                            params=p, adapter=adapters[i % len(adapters)]))
        while engine.stats().running < rows and engine.has_work():  # prefill first: time decode only
            engine.step()
        g0, t0 = engine.stats().generated_tokens, time.perf_counter()
        while engine.has_work():
            engine.step()
    return (engine.stats().generated_tokens - g0) / (time.perf_counter() - t0)


def run(model, rows: int, tokens: int, rank: int) -> dict[str, Any]:
    budget = KV_BUDGET_MB if mx.default_device() == mx.gpu else 512  # the CPU shares its memory with everyone
    config = Config(engine=EngineConfig(max_num_seqs=rows, max_prefill_tokens=4096, max_prefill_rows=64,
                                        kv_budget_mb=budget))
    engine = Engine(EngineModel(model, (), 2048), config)
    out = {"rows": rows, "base": decode_tok_s(engine, [""], rows, tokens, "b")}
    for name, seed in (("one", 1), ("two", 2)):
        cfg, blob = expert_lora(model, rank, seed)
        engine.load_adapter(name, config=cfg, weights=blob)
    out["loaded"] = decode_tok_s(engine, [""], rows, tokens, "l")
    out["single"] = decode_tok_s(engine, ["one"], rows, tokens, "s")
    out["mixed"] = decode_tok_s(engine, ["one", "two", ""], rows, tokens, "m")
    out["adapter_mib"] = round(engine.adapters.nbytes / 2 ** 20 / 2, 1)
    out["passes"] = dict(engine.adapters.router.passes)
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in out.items()}


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# LoRA on MoE experts: decode tokens/s ({data['shape']}, rank {data['rank']})", "",
             f"`{data['command']}`", "", "| rows | base | adapters loaded, unused | all rows one adapter | "
             "two adapters + base | one adapter's size |", "|---:|---:|---:|---:|---:|---:|"]
    for r in data["runs"]:
        lines.append(f"| {r['rows']} | {r['base']} | {r['loaded']} ({r['loaded'] / r['base']:.2f}x) | {r['single']} "
                     f"({r['single'] / r['base']:.2f}x) | {r['mixed']} ({r['mixed'] / r['base']:.2f}x) "
                     f"| {r['adapter_mib']} MiB |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny-moe", choices=sorted(s for s in SHAPES if "moe" in s or "a3b" in s))
    parser.add_argument("--rows", default="8,32", help="decode rows, comma-separated (%(default)s)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokenizer-dir", type=Path, help="a directory with tokenizer files (default: none copied)")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "parallm-bench-gpu")
    add_results_options(parser)
    args = parser.parse_args(argv)
    from mlx_lm.utils import load_model

    results = Results.from_args("moe-lora", args, argv, experiment="" if args.shape == "tiny-moe" else args.shape)
    tok = args.tokenizer_dir or Path(tempfile.mkdtemp())
    model, _ = load_model(build_model_dir(args.shape, args.work_dir / args.shape, tok))
    data: dict[str, Any] = {"shape": args.shape, "rank": args.rank, "tokens": args.tokens, "runs": []}
    for rows in (int(r) for r in args.rows.split(",")):
        data["runs"].append(run(model, rows, args.tokens, args.rank))
        print(data["runs"][-1], flush=True)
        results.write(data)
    data["command"] = results.command
    results.md.write_text(markdown(data))
    print(f"wrote {results.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
