"""Issue 30's long-prefill canary, in process: a short request's latency while one long uncached prompt
prefills, with every step's phases, row operations, pass shape and the pacer's budget recorded.

The HTTP bench (`perf/bench_isolation.py --attacks long_prefill_6k`) measures the canary through every
stage; this one drives the engine directly (the default model, the engine's default settings on this
device) so a run takes minutes and each canary's latency can be split into the steps it waited for.
A canary ("Hello i", max_tokens 2, greedy) is added when the previous one has finished, closed loop as the
HTTP canary; its latency runs from the step boundary it was added at to the step that returned its last
token (so it leaves out the wait for the step in flight at arrival, at most one more step).
`--skip N` computes the long prompt's first N tokens first (unpaced), as a prompt of its own whose blocks land in
the prefix cache, so the measured prefill starts at position N (the expensive end of a long prompt, sooner; the
pacer then learns its rate from the first measured passes).

    python -m perf.bench_long_prefill [--prompt-tokens 6000] [--skip 0] [--prompt-logprobs 0]
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
    print(f"[long-prefill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_engine(overrides: dict[str, Any]):
    import msgspec

    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model, load_tokenizer

    lm = load_model(ModelConfig())
    lm.tokenizer = load_tokenizer(lm.source)
    config = Config(engine=msgspec.structs.replace(EngineConfig(), **overrides))
    return Engine(EngineModel(lm.model, tuple(lm.eos_token_ids), lm.max_model_len, lm.vocab_size), config), lm


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from parallm.engine import Request
    from parallm.protocol import RequestSpec, SamplingParams

    overrides: dict[str, Any] = {}
    if args.prefill_pass_s is not None:
        overrides["prefill_pass_s"] = args.prefill_pass_s
    if args.mixed_passes is not None:
        overrides["mixed_passes"] = args.mixed_passes
    engine, lm = make_engine(overrides)
    if args.no_gap:  # the row layout before issue 30's gap: every prefilling row moved to close it
        engine.scheduler.move_limit = 1 << 62
    tok = lm.tokenizer
    warm = engine.warm_up()
    log(f"warm-up {warm:.1f} s; settings: max_prefill_tokens {engine.config.max_prefill_tokens}, "
        f"prefill_pass_s {engine.config.prefill_pass_s}, mixed {engine.config.mixed_passes}, "
        f"overlap {engine.config.overlap}, kv budget {engine.kv_budget_bytes >> 20} MiB")
    prompt = [(7 * i) % 40000 + 100 for i in range(args.prompt_tokens)]  # bench_isolation's LONG_PROMPT
    if args.skip:
        t0 = time.perf_counter()
        target, engine.pacer.target_s = engine.pacer.target_s, 0.0  # full-budget passes: sooner
        engine.add_request(Request("skip", prompt[:args.skip], RequestSpec(params=SamplingParams(max_tokens=1))))
        while engine.has_work():
            engine.step()
        engine.pacer.target_s = target
        log(f"first {args.skip} tokens prefilled and cached in {time.perf_counter() - t0:.1f} s")
    records: list[dict[str, Any]] = []
    end = engine.trace.end

    def traced_end(kind: str, has_work: bool) -> None:
        r = engine.trace._record
        end(kind, has_work)
        if r is not None:
            records.append({"step": len(records), "kind": r.kind, "ms": r.ms, "phase_ms": r.phase_ms,
                            "ops": dict(r.ops), "prefill_rows": r.prefill_rows,
                            "prefill_tokens": r.prefill_tokens, "L": r.prefill_length, "span": r.prefill_span,
                            "decode_rows": r.decode_rows, "admitted": r.admitted})

    engine.trace.end = traced_end
    params = SamplingParams(max_tokens=1, prompt_logprobs=args.prompt_logprobs or None)
    engine.add_request(Request("long", prompt, RequestSpec(params=params)))
    canaries: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    long_done = None
    t_start = time.perf_counter()
    i = 0
    last_log = time.perf_counter()
    while long_done is None or current is not None:
        if time.perf_counter() - last_log > args.progress_s and records:
            last_log = time.perf_counter()
            r = records[-1]
            log(f"long at {r.get('long_at')}, {len(canaries)} canaries (last {canaries[-1]['s'] if canaries else '-'} s, "
                f"{canaries[-1]['steps'] if canaries else '-'} steps), step {r['step']}: {r['kind']} {r['ms']:.0f} ms "
                f"{r['phase_ms']} ops {r['ops']} prefill {r['prefill_rows']}x{r['L']} budget {r.get('budget_before')}")
        if current is None and long_done is None:
            i += 1
            ids = tok.encode(f"Hello {i}")
            current = {"rid": f"c{i}", "t0": time.perf_counter(), "step0": len(records),
                       "long_at": engine._requests["long"][0].num_computed, "tokens": 0}
            engine.add_request(Request(current["rid"], ids, RequestSpec(params=SamplingParams(
                max_tokens=2, temperature=0.0))))
        budget = engine.scheduler.admission.pass_tokens
        outs = engine.step()
        if records:
            records[-1]["budget"] = engine.scheduler.admission.pass_tokens
            records[-1]["budget_before"] = budget
            records[-1]["rate"] = engine.pacer.seconds_per_unit
            records[-1]["fixed_s"] = engine.pacer.fixed_s
            records[-1]["long_at"] = engine._requests["long"][0].num_computed if "long" in engine._requests else None
            records[-1]["live"] = [engine.runner.live.rows, engine.runner.live.capacity]
        for o in outs:
            if o.rid == "long" and o.finish_reason is not None:
                long_done = time.perf_counter() - t_start
            if current is not None and o.rid == current["rid"]:
                current["tokens"] += len(o.token_ids)
                if o.finish_reason is not None:
                    current["s"] = round(time.perf_counter() - current["t0"], 4)
                    current["steps"] = len(records) - current["step0"]
                    del current["t0"]
                    canaries.append(current)
                    current = None
        if not engine.has_work() and current is None:
            break
        if args.max_canaries and len(canaries) >= args.max_canaries and current is None:
            break  # a sample of the prefill, not all of it
    lat = [c["s"] for c in canaries]
    third = max(1, len(lat) // 3)
    summary = {"canaries": len(lat), "p50_s": round(statistics.median(lat), 4), "p99_s": round(percentile(lat, 0.99), 4),
               "max_s": round(max(lat), 4), "last_third_p50_s": round(statistics.median(lat[-third:]), 4),
               "max_steps": max(c["steps"] for c in canaries), "long_s": round(long_done or 0.0, 2),
               "load_1m": round(os.getloadavg()[0], 1)}
    step_ms = [r["ms"] for r in records]
    summary["step_ms_p50"], summary["step_ms_max"] = round(statistics.median(step_ms), 1), round(max(step_ms), 1)
    return {"settings": {"prompt_tokens": args.prompt_tokens, "skip": args.skip, "no_gap": args.no_gap,
                         "max_canaries": args.max_canaries,
                         "prompt_logprobs": args.prompt_logprobs, **overrides,
                         "max_prefill_tokens": engine.config.max_prefill_tokens,
                         "prefill_pass_s": engine.config.prefill_pass_s, "mixed_passes": engine.config.mixed_passes},
            "summary": summary, "canaries": canaries, "steps": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_long_prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=6000, help="the long prompt's length (%(default)s)")
    parser.add_argument("--skip", type=int, default=0, help="its first tokens computed beforehand and cached")
    parser.add_argument("--prompt-logprobs", type=int, default=0, help="the long prompt asks prompt_logprobs k")
    parser.add_argument("--prefill-pass-s", type=float, default=None, help="engine.prefill_pass_s (default: the engine's)")
    parser.add_argument("--mixed-passes", type=int, default=None, help="engine.mixed_passes 0/1 (default: the engine's)")
    parser.add_argument("--max-canaries", type=int, default=0, help="stop after this many canaries (0: at the prefill's end)")
    parser.add_argument("--no-gap", action="store_true", help="close the row gap whatever it moves (the old layout)")
    parser.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--slowest", type=int, default=12, help="slowest steps printed (%(default)s)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    blas.reexec_with_openblas()
    results = Results.from_args("long-prefill", args, argv)
    data = run(args)
    s = data["summary"]
    lines = [f"canaries {s['canaries']}: p50 {s['p50_s']} s, p99 {s['p99_s']} s, max {s['max_s']} s "
             f"(last third p50 {s['last_third_p50_s']} s), at most {s['max_steps']} steps; long prompt {s['long_s']} s; "
             f"steps p50 {s['step_ms_p50']} ms, max {s['step_ms_max']} ms; load {s['load_1m']}"]
    for r in sorted(data["steps"], key=lambda r: -r["ms"])[:args.slowest]:
        lines.append(f"  step {r['step']} {r['kind']} {r['ms']:.0f} ms {r['phase_ms']} ops {r['ops']} "
                     f"prefill {r['prefill_rows']}x{r['L']} ({r['prefill_tokens']} tok, span {r['span']}) "
                     f"decode {r['decode_rows']} budget {r.get('budget_before')} live {r.get('live')}")
    print(results.write(data, "\n".join(lines)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
