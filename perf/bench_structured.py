"""Grammar-constrained decoding, in process: decode tok/s with a JSON-schema constraint vs none.

Measures:
  a. decode tok/s of the Engine with a JSON-schema constraint vs none at each batch size (same
     prompts, seeds, temperature 1, max_tokens; the schema holds a long string so no constrained
     row can end before max_tokens), on the default model (SmolLM2-135M-Instruct) or on random
     weights of a real shape (--shape, perf/bench_gpu.py's shapes: no hub on the GPU machine);
  b. grammar compile time: the tokenizer's llguidance setup (once per engine), a new schema's
     compile to first mask (cold, a distinct schema each time), and a cached schema's matcher.

Each checkout measured runs in its own worker process with that checkout first on PYTHONPATH: this
one; with --baseline DIR another (a `git worktree` of the base commit); with --serial this one
with overlap off, which is the schedule a constrained row had before issue 20's round 3 (each
constrained launch read before the next one was built). The points are taken in turn (batch,
repeat, checkout, none / json_schema), so load on the machine falls on all alike. --overlap picks
the schedule of the others (engine.overlap; default: the engine's, on with a GPU, off on MLX's CPU
device). On a CPU, OpenBLAS is preloaded (parallm.blas), as the served engine has it.

The issue's goal is >= 0.9x the unconstrained tok/s at batch 16.

    python -m perf.bench_structured [--quick]          # -> perf/results/structured-<device>.{json,md}
    python -m perf.bench_structured --overlap on --baseline /tmp/base --experiment overlap   # this CPU, A/B

On a GPU host (llguidance is a dependency: its wheel, llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64,
is in .gpu/b and installed by .gpu/b/install.sh), the round-2 schedule beside this one:

    python -m perf.bench_structured --shape llama-3.2-3b --batches 1,16,64 --max-tokens 128 --repeats 2 \
        --tokenizer-dir .gpu-tok --serial --experiment serial --out-dir "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "genre": {"enum": ["drama", "comedy", "documentary"]},
    "summary": {"type": "string", "minLength": 2000}},
    "required": ["title", "year", "genre", "summary"], "additionalProperties": False}
PROMPT = "Write a JSON description of a film."
HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the worker (one per checkout)
def make_engine(model_path: str, max_num_seqs: int, overlap: bool | None):
    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model

    # the default model in float32 as perf/bench_engine (the CPU's quantized matmul is slow); a shape as built
    model_config = ModelConfig(path=model_path) if model_path else ModelConfig(dtype="float32")
    loaded = load_model(model_config)
    config = Config(model=model_config, engine=EngineConfig(max_num_seqs=max_num_seqs, prefix_cache=False,
                                                            overlap=overlap))
    return Engine(EngineModel.of(loaded), config), model_config


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


def worker(setup: dict[str, Any]) -> int:
    """Serve decode_rate points, one JSON line in and out, for the checkout first on PYTHONPATH."""
    import mlx.core as mx

    import parallm
    from parallm.models import load_tokenizer, resolve_model

    engine, model_config = make_engine(setup["model"], setup["max_num_seqs"], setup["overlap"])
    source = resolve_model(model_config)
    tok = load_tokenizer(source)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(text, add_special_tokens=False)
    decode_rate(engine, prompt_ids, 1, 4, True)  # warm-up: MLX kernels, the tokenizer, the worker thread
    decode_rate(engine, prompt_ids, 1, 4, False)
    print(json.dumps({"ready": True, "parallm": str(Path(parallm.__file__).parent), "model_dir": str(source.path),
                      "vocab_size": engine.vocab_size, "eos": engine.eos_token_ids, "device": str(mx.default_device()),
                      "overlap": engine.config.overlap}), flush=True)
    for line in sys.stdin:
        point = json.loads(line)
        print(json.dumps(decode_rate(engine, prompt_ids, point["batch"], point["max_tokens"], point["constrained"])),
              flush=True)
    return 0


class Worker:
    """A worker process measuring checkout `root` (its parallm first on PYTHONPATH)."""

    def __init__(self, name: str, root: Path, setup: dict[str, Any]) -> None:
        self.name = name
        path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--worker", json.dumps(setup)], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._reply()
        if Path(self.info["parallm"]).resolve() != (root / "parallm").resolve():
            raise SystemExit(f"{name}: the worker imported {self.info['parallm']}, not {root / 'parallm'}")
        log(f"{name}: {self.info}")

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited ({self.proc.wait()})")
        return json.loads(line)

    def point(self, batch: int, max_tokens: int, constrained: bool) -> dict[str, float]:
        self.proc.stdin.write(json.dumps({"batch": batch, "max_tokens": max_tokens, "constrained": constrained}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---------------------------------------------------------------------- compile times (this checkout)
def compile_times(model_dir: Path, vocab_size: int, eos: list[int], n: int) -> dict[str, float]:
    import llguidance
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask

    from parallm.engine.constraints import Constraints, tokenizer_from_file
    from parallm.protocol import Constraint
    from parallm.text.grammar import compile_text

    t0 = time.perf_counter()
    tok = tokenizer_from_file(model_dir / "tokenizer.json", vocab_size, eos)
    setup = time.perf_counter() - t0
    cons = Constraints(vocab_size, eos)
    cons.use_tokenizer(tok)

    cold, warm = [], []
    buf = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
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


def model_path(args: argparse.Namespace) -> str:
    """The model directory to serve: random weights of --shape (perf.bench_serving.shape_model_dir, built
    once), else --model, else the default model."""
    if not args.shape:
        return args.model
    from perf.bench_serving import shape_model_dir

    return str(shape_model_dir(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(json.loads(argv[1]))
    from parallm import blas
    from perf.harness import Results, add_results_options, describe

    blas.reexec_with_openblas()  # MLX's Linux CPU wheel links a reference BLAS ~15-60x slower; workers inherit it
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=0, help="decode tokens per row (default 128, quick 48)")
    ap.add_argument("--repeats", type=int, default=0, help="repeats per point (default 3, quick 1)")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="engine.overlap (auto: the engine's default for the device)")
    ap.add_argument("--baseline", type=Path, help="another checkout (its parallm/ and perf/) measured beside this one")
    ap.add_argument("--serial", action="store_true", help="also this checkout with overlap off: a constrained row's "
                    "schedule before issue 20's round 3 (each constrained launch read before the next)")
    ap.add_argument("--model", default="", help="model path or hub id (default: the default model)")
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
    setup = {"model": model_path(args), "max_num_seqs": max(batches),
             "overlap": {"auto": None, "on": True, "off": False}[args.overlap]}
    trees = [("change", ROOT, setup)]
    if args.baseline:
        trees.append(("baseline", args.baseline.resolve(), setup))
    if args.serial:
        trees.append(("serial", ROOT, {**setup, "overlap": False}))
    workers = [Worker(name, root, s) for name, root, s in trees]
    raw: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for b in batches:
        for r in range(repeats):
            for w in workers:
                for constrained in (False, True):
                    key = f"{w.name}_b{b}_{'json_schema' if constrained else 'none'}"
                    got = w.point(b, max_tokens, constrained)
                    raw.setdefault(key, []).append(round(got["tok_s"], 1))
                    tokens[key] = got["tokens"]
                    log(f"{key} #{r}: {got['tok_s']:.1f} tok/s")
    for w in workers:
        w.close()
    points: dict[str, Any] = {k: {"tok_s": statistics.median(v), "raw_tok_s": v, "tokens": tokens[k]}
                              for k, v in raw.items()}
    for name, _, _ in trees:
        for b in batches:
            points[f"{name}_b{b}_ratio"] = (points[f"{name}_b{b}_json_schema"]["tok_s"]
                                            / points[f"{name}_b{b}_none"]["tok_s"])
    if args.serial:  # round 2 overlapped unconstrained batches only: its ratio is serial json_schema / change none
        for b in batches:
            serial, none = points[f"serial_b{b}_json_schema"]["tok_s"], points[f"change_b{b}_none"]["tok_s"]
            points[f"round2_b{b}_ratio"] = serial / none
    info = workers[0].info
    compiles = compile_times(Path(info["model_dir"]), info["vocab_size"], info["eos"], 5 if args.quick else 20)
    log(f"compile: {compiles}")
    md = ["# Constrained decoding (perf/bench_structured.py)", "", describe(results.machine), "",
          (f"model {Path(info['model_dir']).name}, max_tokens {max_tokens}, temperature 1, repeats {repeats} (median; "
          "taken in turn)"), "",
          "| batch | checkout | none tok/s | json_schema tok/s | ratio |", "|---|---|---|---|---|"]
    for b in batches:
        for w, (name, root, _) in zip(workers, trees):
            none, js = points[f"{name}_b{b}_none"]["tok_s"], points[f"{name}_b{b}_json_schema"]["tok_s"]
            md.append(f"| {b} | {name} ({root.name}, overlap {w.info['overlap']}) | {none:.1f} | {js:.1f} | "
                      f"{points[f'{name}_b{b}_ratio']:.2f} |")
    if args.serial:
        md += ["", "round 2's schedule (constrained launches serial, others overlapped): json_schema / none = "
               + ", ".join(f"{points[f'round2_b{b}_ratio']:.2f} at batch {b}" for b in batches)]
    md += ["", (f"tokenizer setup {compiles['tokenizer_setup_s']:.2f} s; a new schema compiles to its first mask in "
               f"{compiles['cold_compile_first_mask_ms']:.1f} ms (p90 {compiles['cold_compile_p90_ms']:.1f}); "
               f"a cached schema's matcher {compiles['cached_matcher_us']:.0f} us")]
    path = results.write({"max_tokens": max_tokens, "repeats": repeats,
                          "checkouts": {w.name: {"root": str(root), "overlap": w.info["overlap"]}
                                        for w, (_, root, _) in zip(workers, trees)}, "decode": points,
                          "compile": compiles}, "\n".join(md))
    print("\n".join(md))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
