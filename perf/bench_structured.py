"""Grammar-constrained decoding on the embedded default model (SmolLM2-135M-Instruct), in process.

Measures:
  a. decode tok/s of the Engine with a JSON-schema constraint vs none, at batch 1 and 16 (same
     prompts, seeds, temperature 1, max_tokens; the schema holds a long string so no row can end
     before max_tokens and every run decodes the same number of tokens);
  b. grammar compile time: the tokenizer's llguidance setup (once per engine), a new schema's
     compile to first mask (cold, a distinct schema each time), and a cached schema's matcher.

The issue's goal is >= 0.9x the unconstrained tok/s at batch 16.

    python -m perf.bench_structured [--quick]          # -> perf/results/structured-<device>.{json,md}
    python -m perf.bench_structured --shape llama-3.2-3b --batches 1,16,64 --tokenizer-dir DIR   # a GPU host
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from perf.harness import Results, add_results_options, describe

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "genre": {"enum": ["drama", "comedy", "documentary"]},
    "summary": {"type": "string", "minLength": 2000}},
    "required": ["title", "year", "genre", "summary"], "additionalProperties": False}
PROMPT = "Write a JSON description of a film."


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_engine(max_num_seqs: int, model_config=None):
    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model

    model_config = model_config or ModelConfig(dtype="float32")  # as perf/bench_engine: the CPU's quantized matmul is slow
    loaded = load_model(model_config)
    config = Config(model=model_config, engine=EngineConfig(max_num_seqs=max_num_seqs, prefix_cache=False))
    return Engine(EngineModel.of(loaded), config)


def decode_rate(engine, prompt_ids: list[int], batch: int, max_tokens: int, constrained: bool) -> dict[str, float]:
    """Tokens per second of the decode steps (prefill excluded: the first step is not timed)."""
    from parallm.engine import make_request
    from parallm.protocol import Constraint, SamplingParams

    c = Constraint(kind="json_schema", value=json.dumps(SCHEMA)) if constrained else None
    for i in range(batch):
        p = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, constraint=c)
        engine.add_request(make_request(f"r{i}-{time.monotonic_ns()}", prompt_ids, p))
    tokens = 0
    while engine.has_work() and tokens == 0:  # prefill and first tokens
        tokens += sum(len(o.token_ids) for o in engine.step())
    t0, counted = time.perf_counter(), 0
    while engine.has_work():
        counted += sum(len(o.token_ids) for o in engine.step())
    dt = time.perf_counter() - t0
    return {"tok_s": counted / dt, "tokens": counted, "seconds": dt}


def compile_times(engine, model_dir, n: int) -> dict[str, float]:
    import llguidance
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask

    from parallm.engine.constraints import Constraints, tokenizer_from_file
    from parallm.protocol import Constraint
    from parallm.text.grammar import compile_text

    t0 = time.perf_counter()
    tok = tokenizer_from_file(model_dir / "tokenizer.json", engine.vocab_size, engine.eos_token_ids)
    setup = time.perf_counter() - t0
    cons = Constraints(engine.vocab_size, engine.eos_token_ids)
    cons.use_tokenizer(tok)

    cold, warm = [], []
    buf = np.zeros((1, (engine.vocab_size + 31) // 32), dtype=np.int32)
    for i in range(n):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"field_{i}": {"type": "number"}}}
        c = Constraint(kind="json_schema", value=json.dumps(schema))
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, compile_text(c))
        fill_next_token_bitmask(m, buf, 0)
        cold.append(time.perf_counter() - t0)
        cons.check(c)
        t0 = time.perf_counter()
        cons._template(c).deep_copy()
        warm.append(time.perf_counter() - t0)
    return {"tokenizer_setup_s": setup, "cold_compile_first_mask_ms": statistics.median(cold) * 1e3,
            "cold_compile_p90_ms": sorted(cold)[int(0.9 * len(cold))] * 1e3,
            "cached_matcher_us": statistics.median(warm) * 1e6, "schemas": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=0, help="decode tokens per row (default 128, quick 48)")
    ap.add_argument("--repeats", type=int, default=0, help="repeats per point (default 3, quick 1)")
    ap.add_argument("--shape", default="", help="a perf.bench_gpu shape with random weights instead of the default "
                    "model (a GPU host has not the default model's package): the default tokenizer's vocabulary")
    ap.add_argument("--tokenizer-dir", default="", help="tokenizer files for --shape (perf/bench_serving.py)")
    ap.add_argument("--work-dir", default="", help="where --shape's model is built (reused if there)")
    add_results_options(ap, default_help="none")
    args = ap.parse_args(argv)
    results = Results.from_args("structured", args, argv)
    log(describe(results.machine))
    batches = [int(b) for b in args.batches.split(",")]
    max_tokens = args.max_tokens or (48 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    from parallm.config import ModelConfig
    from parallm.models import load_tokenizer, resolve_model
    shaped = None
    if args.shape:
        from perf.bench_serving import shape_model_dir
        shaped = ModelConfig(path=str(shape_model_dir(args)))
    engine = make_engine(max(batches), shaped)
    source = resolve_model(shaped or ModelConfig())
    tok = load_tokenizer(source)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(text, add_special_tokens=False)
    decode_rate(engine, prompt_ids, 1, 4, True)  # warm-up: MLX kernels, the tokenizer, the worker thread
    decode_rate(engine, prompt_ids, 1, 4, False)
    points: dict[str, Any] = {}
    for b in batches:
        for constrained in (False, True):
            runs = [decode_rate(engine, prompt_ids, b, max_tokens, constrained) for _ in range(repeats)]
            key = f"b{b}_{'json_schema' if constrained else 'none'}"
            points[key] = {"tok_s": statistics.median(r["tok_s"] for r in runs),
                           "raw_tok_s": [round(r["tok_s"], 1) for r in runs], "tokens": runs[0]["tokens"]}
            log(f"{key}: {points[key]['tok_s']:.1f} tok/s {points[key]['raw_tok_s']}")
        points[f"b{b}_ratio"] = points[f"b{b}_json_schema"]["tok_s"] / points[f"b{b}_none"]["tok_s"]
    compiles = compile_times(engine, source.path, 5 if args.quick else 20)
    log(f"compile: {compiles}")
    md = ["# Constrained decoding (perf/bench_structured.py)", "", describe(results.machine), "",
          f"max_tokens {max_tokens}, temperature 1, repeats {repeats} (median)", "",
          "| batch | none tok/s | json_schema tok/s | ratio |", "|---|---|---|---|"]
    for b in batches:
        md.append(f"| {b} | {points[f'b{b}_none']['tok_s']:.1f} | {points[f'b{b}_json_schema']['tok_s']:.1f} | "
                  f"{points[f'b{b}_ratio']:.2f} |")
    md += ["", f"tokenizer setup {compiles['tokenizer_setup_s']:.2f} s; a new schema compiles to its first mask in "
               f"{compiles['cold_compile_first_mask_ms']:.1f} ms (p90 {compiles['cold_compile_p90_ms']:.1f}); "
               f"a cached schema's matcher {compiles['cached_matcher_us']:.0f} us"]
    path = results.write({"max_tokens": max_tokens, "repeats": repeats, "decode": points, "compile": compiles},
                         "\n".join(md))
    print("\n".join(md))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
