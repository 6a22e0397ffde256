"""Speculative decoding (issue 36): tok/s with spec.mode ngram (or draft, `--mode draft --draft-model
PATH`) against none, in process on the default model (SmolLM2-135M-Instruct, float32), greedy.

- single stream, repetition-heavy tasks (a code edit, an extraction: the answer copies the prompt) and
  free text (a story: little to copy, the controller keeps the cost down); goal >= 1.5x on the
  first, never below 0.95x on the second;
- a batch of 16 streams of the three tasks at once (spec.disable_batch_size 4 by default: speculation
  is off there); goal not below 0.95x.

Both modes run the same requests on one engine each, rounds alternating which mode goes first; a run
checks that both emitted the same tokens (greedy: speculation changes no token). Decode tok/s is
(tokens - first) / (time of the last - time of the first token); the tok/s figures are the median over
rounds, the speedup the median of the rounds' ratios (the two runs of a round are back to back, under the
same load of a shared machine).

    python -m perf.bench_spec                      # CPU, 3 rounds
    python -m perf.bench_spec --rounds 1 --max-tokens 64 --out-dir /tmp/spec   # a smoke run
    python -m perf.bench_spec --mode draft --draft-model tiny-draft      # a random 2-layer draft (shapes.py)
    python -m perf.bench_spec --mode draft --draft-model default         # the target as its own draft

Draft mode's model: a path, `default`, or a parallm.models.shapes name (built with random weights and the
default model's tokenizer under --work-dir). The GPU side (shapes, acceptance curve, batch 16/64):
perf/bench_spec_draft.py.

Results: perf/results/spec-ngram-<device>.json and .md (draft: spec-draft-<model>-<device>).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from parallm import blas
from perf.harness import Results, add_results_options

CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "cancelled":
            continue
        total += order.amount
        count += 1
        if order.amount > 1000:
            print("large order", order.id, order.amount)
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
'''

RECORDS = "\n".join(f"- {name}, {city}, born {year}, works as a {job}" for name, city, year, job in [
    ("Alice Martin", "Paris", 1984, "pilot"), ("Bruno Costa", "Lisbon", 1990, "chef"),
    ("Chen Wei", "Paris", 1978, "architect"), ("Dana Smith", "Boston", 1995, "nurse"),
    ("Emil Novak", "Prague", 1988, "teacher"), ("Fatima Zahra", "Paris", 1992, "engineer"),
    ("George Brown", "London", 1981, "lawyer"), ("Hana Sato", "Tokyo", 1999, "designer")])

TASKS = {
    "code_edit": f"Here is a Python function:\n\n{CODE}\nRename the variable `total` to `running_sum` everywhere "
                 "and write out the whole function again.",
    "extraction": f"Here is a list of people:\n{RECORDS}\n\nCopy every line of the list exactly as written, "
                  "in the same order, then say which of them live in Paris.",
    "free_text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
REPETITIVE = ("code_edit", "extraction")


def log(msg: str) -> None:
    print(f"[bench_spec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_engine(lm, mode: str, disable_batch_size: int, draft=None):
    from parallm.config import Config, EngineConfig, SpecConfig
    from parallm.engine import Engine, EngineModel

    config = Config(engine=EngineConfig(kv_budget_mb=512), spec=SpecConfig(mode=mode, disable_batch_size=disable_batch_size))
    engine = Engine(EngineModel(lm.model, tuple(lm.eos_token_ids), min(lm.max_model_len, 4096), lm.vocab_size,
                                draft=draft), config)
    engine.warm_up()
    return engine


def run(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy completions of `prompts` at once; tokens per request and the decode rate."""
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = engine.stats().spec
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(make_request(f"b{i}-{time.monotonic_ns()}", ids, params=params))
    tokens: dict[str, list[int]] = {}
    first = last = 0.0
    while engine.has_work():
        for o in engine.step():
            if o.token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens.setdefault(o.rid, []).extend(o.token_ids)
    total = sum(len(t) for t in tokens.values())
    after = engine.stats().spec
    out: dict[str, Any] = {"tokens": total, "wall_s": last - t0, "decode_tok_s": (total - len(prompts)) / (last - first),
                           "e2e_tok_s": total / (last - t0), "ids": [tokens[k] for k in sorted(tokens, key=lambda r: int(r[1:].split("-")[0]))]}
    if after is not None:
        proposed = after.proposed_tokens - before.proposed_tokens
        accepted = after.accepted_tokens - before.accepted_tokens
        rows = after.rows_verified - before.rows_verified
        out.update(acceptance_rate=accepted / proposed if proposed else 0.0,
                   mean_accepted=accepted / rows if rows else 0.0, verify_passes=after.verify_passes - before.verify_passes)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per workload, alternating the mode order")
    parser.add_argument("--max-tokens", type=int, default=192, help="tokens per single-stream request")
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens per request of the batch of 16")
    parser.add_argument("--batch", type=int, default=16, help="streams of the batch workload")
    parser.add_argument("--disable-batch-size", type=int, default=4, help="spec.disable_batch_size")
    parser.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS of the preloaded OpenBLAS")
    parser.add_argument("--mode", choices=("ngram", "draft"), default="ngram", help="the speculating engine's spec.mode")
    parser.add_argument("--draft-model", default="tiny-draft",
                        help="draft mode's model: a path, 'default' or a parallm.models.shapes name (%(default)s)")
    parser.add_argument("--work-dir", default="/tmp/parallm-bench-spec", help="where a shapes draft is built")
    parser.add_argument("--workloads", default="", help="comma-separated workloads to run (default: all)")
    add_results_options(parser, default_help="ngram, or draft-<model>")
    args = parser.parse_args(argv)
    if not args.experiment:
        args.experiment = "ngram" if args.mode == "ngram" else f"draft-{args.draft_model.rstrip('/').split('/')[-1]}"
    if not blas.is_preloaded():
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    blas.reexec_with_openblas()

    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer

    files = Results.from_args("spec", args, argv, experiment=args.experiment)
    lm = load_model(ModelConfig(dtype="float32"))
    mode = args.mode
    draft = load_draft_model(args.draft_model, args.work_dir) if mode == "draft" else None
    tok = load_tokenizer(lm.source)
    prompts = {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                        tokenize=False), add_special_tokens=False)
               for name, text in TASKS.items()}
    engines = {"none": make_engine(lm, "none", args.disable_batch_size),
               mode: make_engine(lm, mode, args.disable_batch_size, draft)}
    workloads = {name: ([ids], args.max_tokens) for name, ids in prompts.items()}
    order = list(prompts)
    workloads[f"batch{args.batch}"] = ([prompts[order[i % len(order)]] for i in range(args.batch)], args.batch_tokens)
    if args.workloads:
        workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}
    results: dict[str, Any] = {"model": lm.source.name, "dtype": "float32", "rounds": args.rounds, "mode": mode,
                               "draft_model": args.draft_model if mode == "draft" else None, "workloads": {},
                               "loadavg_start": os.getloadavg()}
    for name, (batch, max_tokens) in workloads.items():
        runs: dict[str, list[dict[str, Any]]] = {"none": [], mode: []}
        for r in range(args.rounds):
            for m in (("none", mode) if r % 2 == 0 else (mode, "none")):
                runs[m].append(run(engines[m], batch, max_tokens))
        same = all(a["ids"] == b["ids"] for a, b in zip(runs["none"], runs[mode]))
        off = statistics.median(x["decode_tok_s"] for x in runs["none"])
        on = statistics.median(x["decode_tok_s"] for x in runs[mode])
        # the machine's load moves: a round's two runs (back to back) share it, so the figure is the
        # median of the rounds' ratios
        speedup = statistics.median(b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(runs["none"], runs[mode]))
        entry = {"streams": len(batch), "max_tokens": max_tokens, "tokens": runs["none"][0]["tokens"],
                 "off_decode_tok_s": off, f"{mode}_decode_tok_s": on, "speedup": speedup, "same_tokens": same,
                 "acceptance_rate": statistics.median(x["acceptance_rate"] for x in runs[mode]),
                 "mean_accepted": statistics.median(x["mean_accepted"] for x in runs[mode]),
                 "verify_passes": runs[mode][0]["verify_passes"],
                 "off_runs": [x["decode_tok_s"] for x in runs["none"]], f"{mode}_runs": [x["decode_tok_s"] for x in runs[mode]]}
        results["workloads"][name] = entry
        log(f"{name}: off {off:.1f} tok/s, {mode} {on:.1f} tok/s ({speedup:.2f}x), acceptance "
            f"{entry['acceptance_rate']:.2f}, same tokens {same}")
        files.write(results, markdown(results, files.command))
    results["loadavg"] = os.getloadavg()
    files.write(results, markdown(results, files.command))
    return 0


def load_draft_model(name: str, work_dir: str):
    """Draft mode's model: a parallm.models.shapes name (random weights, the default tokenizer's vocabulary,
    built once under `work_dir`), else a model spec (a path, 'default')."""
    from pathlib import Path

    from parallm.config import Config, ModelConfig, SpecConfig
    from parallm.models import load_draft, load_model, load_tokenizer, materialize
    from parallm.models.shapes import SHAPES, build_model_dir

    path = name
    if name in SHAPES:
        default = load_model(ModelConfig(dtype="float32"))
        path = str(build_model_dir(name, Path(work_dir) / name, materialize(default.source, "float32"),
                                   vocab_size=len(load_tokenizer(default.source))))
    return load_draft(Config(model=ModelConfig(dtype="float32"), spec=SpecConfig(mode="draft", draft_model=path))).model


def markdown(results: dict[str, Any], command: str) -> str:
    mode = results.get("mode", "ngram")
    what = "n-gram" if mode == "ngram" else f"draft model {results['draft_model']}"
    lines = [f"# Speculative decoding ({what}) vs off, {results['model']} {results['dtype']}, greedy", "",
             f"`{command}`", "", f"| workload | streams | tokens | off tok/s | {mode} tok/s | speedup | acceptance | "
             "mean accepted | verify passes | same tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in results["workloads"].items():
        lines.append(f"| {name} | {e['streams']} | {e['tokens']} | {e['off_decode_tok_s']:.1f} | "
                     f"{e[f'{mode}_decode_tok_s']:.1f} | {e['speedup']:.2f}x | {e['acceptance_rate']:.2f} | "
                     f"{e['mean_accepted']:.2f} | {e['verify_passes']} | {e['same_tokens']} |")
    lines += ["", f"Speedup: the median over rounds of {mode} / off decode tok/s (each round's two runs back to back). "
              f"Load average at the start: {results.get('loadavg_start', 'n/a')}, at the end: {results.get('loadavg', 'n/a')}."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
