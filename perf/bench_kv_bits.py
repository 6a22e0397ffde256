"""Quantized KV (`--kv.bits 8|4`, parallm/engine/kv_format.py) against the model's dtype: capacity,
agreement and decode step time, in-process on the default model (or a bench_gpu shape on a GPU).

- capacity: `kv_capacity_tokens` (what /metrics exports as parallm_kv_capacity_tokens) of engines at
  the same --engine.kv-budget-mb, for the model's dtype and bfloat16;
- agreement: greedy decoding of `--prompts` chat prompts x `--max-tokens` tokens with full-precision
  KV and with each bits: the fraction of identical tokens (position by position), the prompts whose
  whole output is identical, and the mean |delta logprob| of the full-precision tokens scored
  teacher-forced by the quantized engine (the same context at every position);
- attention: one layer's decode attention over dense K/V and over quantized K/V in each form it can take
  (the quantized matmuls, or dequantizing first), at the model's head shape;
- decode: the mean time of a pure decode step at each `--batches` row count (rows prefilled with
  `--prompt-len` tokens first), per bits, and what attention reads the K/V through.

    python -m perf.bench_kv_bits                       # -> perf/results/kv-bits-<device>.json / .md
    python -m perf.bench_kv_bits --shape llama-3.2-3b --tokenizer-dir DIR --batches 1,64,256   # a GPU (no agreement:
        # random weights)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from perf.harness import Results, add_results_options

TOPICS = ["the moon", "volcanoes", "bread", "chess", "rivers", "the printing press", "honey bees", "glaciers",
          "electric motors", "tea", "the Roman roads", "owls", "rain", "bicycles", "coral reefs", "clocks"]
ASKS = ["Explain in a few sentences how {} works or formed.", "Write a short story that mentions {}."]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        out.append(list(tokenizer.encode(rendered, add_special_tokens=False)))
    return out


def make_engine(model, bits: int, group_size: int, budget_mb: float, max_len: int, **engine):
    from parallm.config import Config, EngineConfig, KVConfig
    from parallm.engine import Engine, EngineModel

    config = Config(engine=EngineConfig(kv_budget_mb=budget_mb, **engine), kv=KVConfig(bits=bits, group_size=group_size))
    return Engine(EngineModel(model, (), max_len), config)


def capacity(model, bits_list: list[int], group_size: int, budget_mb: float) -> list[dict]:
    rows = []
    native = model_dtype(model)
    for dtype in dict.fromkeys([native, "bfloat16"]):
        m = model if dtype == native else cast(model, dtype)
        base = None
        for bits in [0] + bits_list:
            stats = make_engine(m, bits, group_size, budget_mb, 512).stats()
            base = base or stats.kv_capacity_tokens
            rows.append({"dtype": dtype, "bits": bits, "group_size": group_size if bits else None,
                         "kv_budget_mb": budget_mb, "kv_capacity_tokens": stats.kv_capacity_tokens,
                         "bytes_per_token": stats.bytes_per_token, "ratio": stats.kv_capacity_tokens / base})
    return rows


def model_dtype(model) -> str:
    from parallm.engine.compat import check_model

    return str(check_model(model).dtype).removeprefix("mlx.core.")


def cast(model, dtype: str):
    import copy

    m = copy.deepcopy(model)
    m.set_dtype(getattr(mx, dtype))
    mx.eval(m.parameters())
    return m


def generate(engine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    for i, p in enumerate(prompts):
        engine.add_request(make_request(f"a{i}", p, params=params))
    got: dict[str, dict] = {}
    while engine.has_work():
        for o in engine.step():
            d = got.setdefault(o.rid, {"tokens": [], "logprobs": []})
            d["tokens"] += o.token_ids
            d["logprobs"] += o.logprobs or []
    return [got[f"a{i}"] for i in range(len(prompts))]


def agreement(model, prompts: list[list[int]], max_tokens: int, bits_list: list[int], group_size: int,
              budget_mb: float) -> list[dict]:
    full = generate(make_engine(model, 0, group_size, budget_mb, 2048), prompts, max_tokens)
    rows = []
    for bits in bits_list:
        engine = make_engine(model, bits, group_size, budget_mb, 2048)
        quant = generate(engine, prompts, max_tokens)
        same = sum(a == b for f, q in zip(full, quant) for a, b in zip(f["tokens"], q["tokens"]))
        whole = sum(f["tokens"] == q["tokens"] for f, q in zip(full, quant))
        deltas, prefix_deltas = [], []
        for p, f, q in zip(prompts, full, quant):
            scored = engine.score(p + f["tokens"], start=len(p))
            deltas += [abs(a - b) for a, b in zip(f["logprobs"], scored.logprobs)]
            for (ta, la), (tb, lb) in zip(zip(f["tokens"], f["logprobs"]), zip(q["tokens"], q["logprobs"])):
                prefix_deltas.append(abs(la - lb))
                if ta != tb:
                    break
        engine.check_integrity()
        rows.append({"bits": bits, "group_size": group_size, "prompts": len(prompts), "max_tokens": max_tokens,
                     "identical_token_fraction": same / (len(prompts) * max_tokens),
                     "identical_outputs": whole, "mean_abs_dlogprob_teacher_forced": statistics.fmean(deltas),
                     "max_abs_dlogprob_teacher_forced": max(deltas),
                     "mean_abs_dlogprob_greedy_common_prefix": statistics.fmean(prefix_deltas),
                     "read": engine.kv_format.read})
        print(f"agreement bits={bits}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def decode_time(model, batches: list[int], bits_list: list[int], group_size: int, prompt_len: int, steps: int,
                rounds: int, budget_mb: float, vocab: int) -> list[dict]:
    """Per row count, an engine per bits with every row prefilled, then `rounds` rounds of `steps` decode
    steps taking the engines in turn (a loaded machine slows them alike); the median round's step time."""
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    from parallm.engine.compat import check_model
    from parallm.engine.kv_format import KVFormat

    info = check_model(model)
    full_bpt = KVFormat(info.dtype).bytes_per_token(info.shapes)
    rows = []
    for batch in batches:
        engines = {}
        length = prompt_len + steps * rounds + 64
        budget = max(budget_mb, 1.5 * batch * length * full_bpt / (1 << 20))  # every row fits at full precision
        for bits in [0] + bits_list:
            engine = make_engine(model, bits, group_size, budget, length, max_num_seqs=batch, max_prefill_tokens=4096,
                                 prefix_cache=False)
            params = SamplingParams(temperature=0.0, max_tokens=steps * rounds + 16, ignore_eos=True)
            for i in range(batch):
                ids = [(i * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(prompt_len)]
                engine.add_request(make_request(f"d{i}", ids, params=params))
            while engine.stats().running < batch or engine.stats().prefilling:
                engine.step()
            for _ in range(4):
                engine.step()
            engines[bits] = engine
        times: dict[int, list[float]] = {bits: [] for bits in engines}
        for _ in range(rounds):
            for bits, engine in engines.items():
                mx.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                mx.synchronize()
                times[bits].append((time.perf_counter() - start) / steps * 1e3)
        for bits, engine in engines.items():
            ms = statistics.median(times[bits])
            rows.append({"batch": batch, "bits": bits, "step_ms": ms, "rounds_ms": [round(t, 2) for t in times[bits]],
                         "read": engine.kv_format.read, "vs_full_precision": ms / statistics.median(times[0])})
            print(f"decode batch={batch} bits={bits}: {ms:.1f} ms/step", file=sys.stderr, flush=True)
            engine.check_integrity()
    return rows


def attention_forms(batches: list[int], spans: list[int], bits_list: list[int], group_size: int, heads: int,
                    kv_heads: int, dim: int, repeats: int) -> list[dict]:
    """One layer's decode attention (one query per row, a boolean mask) in each form it can take over K/V of
    `spans` positions: dense K/V with the engine's fast-math attention; quantized K/V through the quantized
    matmuls with the fast-math softmax (what the engine runs on the CPU), through mlx-lm's stock quantized
    attention (its softmax on libm's exp; what runs on a GPU), and dequantized first, then dense. The forms
    take turns, `repeats` rounds of 10 calls; the median call."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as stock_quantized

    from parallm.engine.fastmath import scaled_dot_product_attention as fast
    from parallm.engine.kv_format import KVFormat

    rows = []
    for batch in batches:
        for span in spans:
            q = mx.random.normal((batch, heads, 1, dim))
            k, v = mx.random.normal((batch, kv_heads, span, dim)), mx.random.normal((batch, kv_heads, span, dim))
            mask = mx.ones((batch, 1, 1, span), dtype=mx.bool_)
            for bits in bits_list:
                fmt = KVFormat(mx.float32, bits, group_size)
                qk, qv = fmt.encode(k), fmt.encode(v)
                mx.eval(q, k, v, qk, qv)
                forms = {
                    "dense": lambda: fast(q, k, v, None, 0.125, mask),
                    "quantized_matmul_fastmath": lambda: fast(q, qk, qv, fmt, 0.125, mask),
                    "quantized_matmul_stock": lambda: stock_quantized(q * 1.0, qk, qv, 0.125, mask, group_size, bits),
                    "dequantize_then_dense": lambda: fast(q, fmt.decode(qk), fmt.decode(qv), None, 0.125, mask),
                }
                times: dict[str, list[float]] = {name: [] for name in forms}
                for _ in range(repeats):
                    for name, f in forms.items():
                        mx.eval(f())
                        start = time.perf_counter()
                        for _ in range(10):
                            mx.eval(f())
                        times[name].append((time.perf_counter() - start) / 10 * 1e3)
                row = {"batch": batch, "span": span, "bits": bits,
                       **{f"{name}_ms": statistics.median(t) for name, t in times.items()}}
                rows.append(row)
                print(f"attention {row}", file=sys.stderr, flush=True)
    return rows


def markdown(data: dict) -> str:
    commands = sorted(set(data.get("section_commands", {}).values()) or {data["command"]})
    lines = [f"# Quantized KV (`--kv.bits`) vs the model's dtype\n", *[f"`{c}`\n" for c in commands]]
    if data.get("capacity"):
        lines += ["| KV dtype | bits | group | kv_capacity_tokens | bytes/token | x |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['bits'] or '-'} | {r['group_size'] or '-'} | {r['kv_capacity_tokens']} | "
                  f"{r['bytes_per_token']} | {r['ratio']:.2f} |" for r in data["capacity"]]
        lines.append("")
    if data.get("agreement"):
        lines += ["| bits | identical tokens | identical outputs | mean abs dlogprob (teacher-forced) | max | "
                  "mean abs dlogprob (greedy, common prefix) |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['bits']} | {r['identical_token_fraction']:.3f} | {r['identical_outputs']}/{r['prompts']} | "
                  f"{r['mean_abs_dlogprob_teacher_forced']:.4f} | {r['max_abs_dlogprob_teacher_forced']:.3f} | "
                  f"{r['mean_abs_dlogprob_greedy_common_prefix']:.4f} |" for r in data["agreement"]]
        lines.append("")
    if data.get("attention"):
        lines += ["One layer's decode attention, ms (dense K/V; quantized K/V through the quantized matmuls with the "
                  "fast-math softmax, with mlx-lm's stock softmax, and dequantized first):", "",
                  "| rows | span | bits | dense | quantized matmul (fast math) | quantized matmul (stock) | "
                  "dequantize + dense |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['span']} | {r['bits']} | {r['dense_ms']:.3f} | "
                  f"{r['quantized_matmul_fastmath_ms']:.3f} | {r['quantized_matmul_stock_ms']:.3f} | "
                  f"{r['dequantize_then_dense_ms']:.3f} |" for r in data["attention"]]
        lines.append("")
    if data.get("decode"):
        lines += ["| rows | bits | decode step ms | x full precision | attention reads |", "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['bits'] or '-'} | {r['step_ms']:.1f} | {r['vs_full_precision']:.2f} | "
                  f"{r['read'] if r['bits'] else 'dense'} |" for r in data["decode"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="", help="a perf.bench_gpu shape (random weights) instead of the default model")
    parser.add_argument("--tokenizer-dir", type=Path, help="with --shape: a directory with tokenizer.json etc.")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "parallm-bench-gpu")
    parser.add_argument("--bits", default="8,4")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--budget-mb", type=float, default=256.0)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per engine and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spans", default="256,1024", help="attention: key positions")
    parser.add_argument("--skip", default="", help="comma-separated: capacity, agreement, attention, decode")
    add_results_options(parser, "")
    args = parser.parse_args(argv)
    if mx.default_device() == mx.cpu:
        from parallm import blas

        blas.reexec_with_openblas()  # the engine stage gets OpenBLAS on a CPU (MLX's own BLAS: 15-60x slower)
    bits_list = [int(b) for b in args.bits.split(",") if b]
    skip = set(filter(None, args.skip.split(",")))
    if args.shape:
        from parallm.config import ModelConfig
        from parallm.models import load_model
        from perf.bench_gpu import build_model_dir  # a GPU run's random-weight model: no agreement figures

        lm = load_model(ModelConfig(path=str(build_model_dir(args.shape, args.work_dir / args.shape,
                                                             args.tokenizer_dir))))
        tokenizer = None
    else:
        from parallm.config import ModelConfig
        from parallm.models import load_model, load_tokenizer

        lm = load_model(ModelConfig())
        tokenizer = load_tokenizer(lm.source)
    files = Results.from_args("kv-bits", args, argv, experiment=args.shape)
    data: dict = {"command": files.command, "bits": bits_list, "group_size": args.group_size, "section_commands": {}}
    previous = files.previous()  # the sections this run skips keep the last run's figures, with its command
    for section in ("capacity", "agreement", "attention", "decode"):
        if section in skip and section in previous:
            data[section] = previous[section]
            data["section_commands"][section] = previous.get("section_commands", {}).get(section, previous["command"])
        elif section not in skip:
            data["section_commands"][section] = files.command
    if "capacity" not in skip:
        data["capacity"] = capacity(lm.model, bits_list, args.group_size, args.budget_mb)
        files.write(data, markdown(data))
    if "agreement" not in skip and tokenizer is not None:  # random weights (--shape): no agreement figures
        prompts = chat_prompts(tokenizer, args.prompts)
        data["agreement"] = agreement(lm.model, prompts, args.max_tokens, bits_list, args.group_size, args.budget_mb)
        files.write(data, markdown(data))
    if "attention" not in skip:
        from parallm.engine.compat import check_model

        shape = check_model(lm.model).shapes[0]
        heads = lm.model.args.num_attention_heads if hasattr(lm.model, "args") else 4 * shape.k_heads
        data["attention"] = attention_forms([int(b) for b in args.batches.split(",") if b],
                                            [int(t) for t in args.spans.split(",") if t], bits_list, args.group_size,
                                            heads, shape.k_heads, shape.k_dim, args.rounds)
        files.write(data, markdown(data))
    if "decode" not in skip:
        batches = [int(b) for b in args.batches.split(",") if b]
        data["decode"] = decode_time(lm.model, batches, bits_list, args.group_size, args.prompt_len, args.steps,
                                     args.rounds, args.budget_mb, lm.vocab_size)
        files.write(data, markdown(data))
    print(markdown(data))
    print(f"wrote {files.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
