"""What a verify pass costs against a plain decode step (issue 36), in process on the default model
(SmolLM2-135M-Instruct, float32, greedy), one stream: the engine's decode ms per step with spec.mode none
(a 1-token step, overlapped) and with every step a verify pass of L = 1 + k tokens (a fixed proposal of
k tokens that is always rejected, so each pass emits one token and costs a whole step).

Why it matters: n-gram speculation pays where (1 + accepted) / cost(L) > 1. On the 2-core CI machine
(OpenBLAS, one thread) the cost is a step function of L: the sgemm kernel works in blocks of 4 tokens, so a
pass of 3, 5 or 7 tokens costs more than one of 4 or 8 (spec.verify_multiple; docs/performance.md).

    python -m perf.bench_spec_verify_cost                        # L = 1..9, 12, 16; 2 rounds
    python -m perf.bench_spec_verify_cost --lengths 1,4,8 --rounds 1 --tokens 32 --out-dir /tmp/v   # a smoke run

Results: perf/results/spec-verify-cost-<device>.json and .md.
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


def log(msg: str) -> None:
    print(f"[bench_spec_verify_cost {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1,2,3,4,5,6,7,8,9,12,16", help="verify pass lengths L = 1 + k (1: spec off)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the lengths")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per run")
    parser.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS of the preloaded OpenBLAS")
    add_results_options(parser, experiment="verify-cost")
    args = parser.parse_args(argv)
    if not blas.is_preloaded():
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    blas.reexec_with_openblas()

    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer
    from perf.bench_spec import TASKS, make_engine, run

    files = Results.from_args("spec", args, argv, experiment="verify-cost")
    lm = load_model(ModelConfig(dtype="float32"))
    tok = load_tokenizer(lm.source)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": TASKS["code_edit"]}],
                                             add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    off = make_engine(lm, "none", 4)
    on = make_engine(lm, "ngram", 4)
    k = [0]
    spec = on.spec
    assert spec is not None
    # every step a verify pass of 1 + k tokens whose proposal (a token the model does not emit) is rejected
    wrong = 0 if 0 not in ids else max(ids) + 1
    spec.proposer.propose = lambda key, tokens, n: [wrong] * min(n, k[0])  # type: ignore[method-assign]
    spec.control.k = lambda key: k[0]  # type: ignore[method-assign]
    spec.control.record = lambda *a: None  # type: ignore[method-assign]
    lengths = [int(x) for x in args.lengths.split(",")]
    ms: dict[int, list[float]] = {L: [] for L in lengths}
    load_start = os.getloadavg()
    for _ in range(args.rounds):
        for L in lengths:
            k[0] = L - 1
            r = run(off if L == 1 else on, [ids], args.tokens)
            ms[L].append(1000 / r["decode_tok_s"])
    base = statistics.median(ms[1]) if 1 in ms else None
    rows = {str(L): {"ms_per_step": statistics.median(v), "runs": v,
                     "vs_plain": statistics.median(v) / base if base else None} for L, v in ms.items()}
    for L, e in rows.items():
        log(f"L={L}: {e['ms_per_step']:.1f} ms/step" + (f" ({e['vs_plain']:.2f}x a plain step)" if base else ""))
    results: dict[str, Any] = {"model": lm.source.name, "dtype": "float32", "tokens": args.tokens, "rounds": args.rounds,
                               "lengths": rows, "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    files.write(results, markdown(results, files.command))
    return 0


def markdown(results: dict[str, Any], command: str) -> str:
    lines = [f"# A verify pass of L tokens vs a plain decode step, {results['model']} {results['dtype']}, one stream", "",
             f"`{command}`", "", "| L (1 + k) | ms per step | vs a plain step | runs |", "|---|---|---|---|"]
    for L, e in results["lengths"].items():
        vs = f"{e['vs_plain']:.2f}x" if e["vs_plain"] else "n/a"
        lines.append(f"| {L} | {e['ms_per_step']:.1f} | {vs} | {', '.join(f'{x:.1f}' for x in e['runs'])} |")
    lines += ["", "L = 1: spec.mode none (overlapped decode); L > 1: every step one verify pass of L tokens whose proposal "
              "is rejected (one token emitted per pass). Load average at the start "
              f"{results['loadavg_start']}, at the end {results['loadavg_end']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
