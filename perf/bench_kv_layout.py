"""The KV layout in the engine (bench_engine's section k): decode step time at batch 1/16/64 and the
bytes the row operations copy, by kind, in a churning workload (shared prefixes, n = 2, rows
finishing at different lengths), on the embedded default model (SmolLM2-135M-Instruct, float32).

Each variant runs in child processes that alternate on the same machine: this checkout with
engine settings (`--variant NAME:KEY=VALUE,...`, e.g. `paged:paged_decode=auto` or
`gather:paged_decode=off`), and with `--compare-tree DIR` another checkout as "dense" (e.g. the
dense rows of main before the block store, where settings this tree added do not exist).

    git -C /work/main worktree add /tmp/dense main
    python -m perf.bench_kv_layout --compare-tree /tmp/dense \\
        --variant paged:paged_decode=auto --variant gather:paged_decode=off   # -> perf/results/kv-layout-cpu.*
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from perf.harness import Results, add_results_options, describe

HERE = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[kv-layout {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _op_bytes(op: Any, bytes_per_token: int, block_size: int) -> tuple[str, int]:
    """(kind, KV bytes it copies) of one row op, in either tree's ops."""
    kind = type(op).__name__
    if kind == "LoadPrefix":
        return kind, len(op.block_ids) * block_size * bytes_per_token
    if kind == "WriteBack":
        return kind, len(op.blocks) * block_size * bytes_per_token
    if kind == "CopyBlocks":
        return kind, len(op.pairs) * block_size * bytes_per_token
    if kind in ("CopyRow", "SwapRows") and not hasattr(op, "pairs"):
        from parallm.engine import plan

        if not hasattr(plan, "CopyBlocks"):  # the dense rows copy the KV with the row
            return kind, op.ntokens * bytes_per_token * (2 if kind == "SwapRows" else 1)
    return kind, 0  # the block store's row moves touch per-row state only; a Resize's copy is not counted


def step_times(engine, P, batches: list[int], steps: int, context: int) -> dict[str, Any]:
    """Per batch size: ms per pure decode step (median of `steps`) with every row at `context` tokens."""
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    out = {}
    for batch in batches:
        for i, ids in enumerate(P.batch(batch, context, seed=300 + batch)):
            engine.add_request(make_request(f"k{batch}-{i}", ids, params=SamplingParams(
                temperature=0.0, max_tokens=steps + 64, ignore_eos=True)))
        while engine.stats().running < batch or engine.stats().prefilling or engine.stats().waiting:
            engine.step()
        for _ in range(4):  # warm-up decode steps
            engine.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        out[str(batch)] = {"step_ms_median": 1000 * statistics.median(times), "step_ms_min": 1000 * min(times)}
        for i in range(batch):
            engine.abort(f"k{batch}-{i}")
        while engine.has_work():
            engine.step()
    return out


def churn(engine, P, requests: int) -> dict[str, Any]:
    """Row-op KV bytes by kind over a churning workload: shared prefixes (hits), n = 2 forks, rows
    finishing at different lengths (moves)."""
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    runner = engine.runner
    bpt, bs = runner.live.bytes_per_token, engine.config.block_size
    counts: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    execute = runner.execute

    def counted(ops, *a, **kw):
        for op in ops:
            kind, b = _op_bytes(op, bpt, bs)
            counts[kind] = counts.get(kind, 0) + 1
            nbytes[kind] = nbytes.get(kind, 0) + b
        return execute(ops, *a, **kw)

    runner.execute = counted
    before = engine.stats()
    rng = random.Random(41)
    prefixes = [P.text_ids(64, 4100 + k) for k in range(4)]
    t0 = time.perf_counter()
    for i in range(requests):
        ids = rng.choice(prefixes) + P.text_ids(rng.randrange(8, 120), 4200 + i)
        engine.add_request(make_request(f"c{i}", ids, n=2 if i % 5 == 0 else 1, params=SamplingParams(
            temperature=0.0, max_tokens=rng.randrange(4, 48), ignore_eos=True)))
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - t0
    runner.execute = execute
    st = engine.stats()
    engine.check_integrity()
    return {"requests": requests, "wall_s": wall, "op_counts": counts, "op_kv_bytes": nbytes,
            "copy_bytes_total": sum(nbytes.values()),
            "prefix_hit_tokens": st.prefix_hit_tokens - before.prefix_hit_tokens,
            "generated_tokens": st.generated_tokens - before.generated_tokens, "steps": st.steps - before.steps}


def child(args) -> dict[str, Any]:
    """One tree's measurement with these settings (JSON on stdout)."""
    import parallm
    from parallm import blas
    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer
    from perf.bench_engine import Prompts, make_engine

    blas.reexec_with_openblas()
    lm = load_model(ModelConfig(dtype="float32"))
    P = Prompts(load_tokenizer(lm.source))
    engine = make_engine(lm, max_num_seqs=max(args.batches), **json.loads(args.settings))
    runner = engine.runner
    return {"tree": str(Path(parallm.__file__).resolve().parents[1]),
            "paged_way": getattr(runner, "paged_way", None) if getattr(runner, "pages_decode", False) else None,
            "steps": step_times(engine, P, args.batches, args.steps, args.context),
            "churn": churn(engine, P, args.requests) if args.requests else None}


def _parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = text.partition(":")
    settings: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        settings[key] = json.loads(value) if value[:1] in "0123456789-[{tfn" and value not in ("gather", "gather_mm") \
            else value
    return name, settings


def markdown(res: dict[str, Any]) -> str:
    names = [n for n in res["variants"] if n in res["summary"]]
    base = names[0]
    lines = ["# KV layout: decode step time and row-op copies (CPU)", "",
             f"Machine: {describe(res['machine'])}.  ", f"Command: `{res['command']}`  ",
             f"Load average 1/5/15 min at start {res['loadavg_start']}, at end {res['loadavg_end']} "
             f"({res['machine']['cpus']} CPUs; figures at a load above ~6 are noise).", "",
             f"Decode step time with every row at {res['context']} tokens, median ms of {res['steps']} steps, "
             f"median over {res['repeats']} alternating child runs per variant (in parentheses the fastest step "
             "of all its runs, the better guide on a loaded machine):", "",
             "| batch | " + " | ".join(f"{n} ms" for n in names) + " | " +
             " | ".join(f"{n}/{base}" for n in names[1:]) + " |",
             "|---:|" + "---:|" * (2 * len(names) - 1)]
    for b in res["batches"]:
        med = {n: res["summary"][n]["step_ms"][str(b)] for n in names}
        low = {n: res["summary"][n].get("step_ms_min", {}).get(str(b)) for n in names}
        row = [f"{med[n]:.2f}" + (f" ({low[n]:.2f})" if low[n] is not None else "") for n in names]
        row += [f"{med[n] / med[base]:.3f}x" + (f" ({low[n] / low[base]:.3f}x)" if low[n] and low[base] else "")
                for n in names[1:]]
        lines.append(f"| {b} | " + " | ".join(row) + " |")
    lines += ["", "(time ratios: below 1 is faster than the first variant.) Load average (1 min) at the end of each run: "
              + "; ".join(f"{n} " + ", ".join(str(r.get("loadavg_end", "?")) for r in res["runs"][n]) for n in names)]
    if res["requests"]:
        lines += ["", f"Row operations of the churn workload ({res['requests']} requests: 4 shared 64-token prefixes, "
                  "every 5th n = 2, 4-48 output tokens): count / KV bytes copied", "",
                  "| variant | op | count | KV bytes |", "|---|---|---:|---:|"]
    for n in names:
        c = res["summary"][n]["churn"]
        if c is None:
            continue
        for op, count in sorted(c["op_counts"].items()):
            lines.append(f"| {n} | {op} | {count} | {c['op_kv_bytes'].get(op, 0)} |")
        lines.append(f"| {n} | all | | {c['copy_bytes_total']} (wall {c['wall_s']:.2f} s, {c['steps']} steps, "
                     f"{c['prefix_hit_tokens']} prefix-hit tokens) |")
    lines += ["", "Variants: " + "; ".join(f"{n} = {res['variants'][n]['tree']} {res['variants'][n]['settings']} "
                                           f"(paged decode: {res['summary'][n].get('paged_way')})" for n in names), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_options(parser)
    parser.add_argument("--compare-tree", help="another checkout measured as variant 'dense' (run first)")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:KEY=VALUE,... engine settings of a variant of this checkout (repeatable; "
                             "default 'paged' with the defaults)")
    parser.add_argument("--engine", default="", metavar="KEY=VALUE,...",
                        help="engine settings of every variant, the compared tree's too (e.g. prefill_pass_s=0,"
                             "max_prefill_tokens=4096: the rows fill in a few passes instead of the CPU pacer's "
                             "small chunks)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    parser.add_argument("--context", type=int, default=256, help="each row's tokens before timing")
    parser.add_argument("--requests", type=int, default=96, help="requests of the churn workload (0: none)")
    parser.add_argument("--repeats", type=int, default=3, help="child runs per variant, alternating")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        json.dump(child(args), sys.stdout)
        return 0
    variants: dict[str, dict[str, Any]] = {}
    _, common = _parse_variant(f"all:{args.engine}")
    if args.compare_tree:
        variants["dense"] = {"tree": str(Path(args.compare_tree).resolve()), "settings": dict(common)}
    for text in args.variant or ["paged:"]:
        name, settings = _parse_variant(text)
        variants[name] = {"tree": str(HERE), "settings": {**common, **settings}}
    files = Results.from_args("kv-layout", args, argv)
    res: dict[str, Any] = {"command": files.command, "machine": files.machine, "variants": variants,
                           "batches": args.batches, "steps": args.steps, "context": args.context,
                           "requests": args.requests, "repeats": args.repeats,
                           "loadavg_start": [round(x, 2) for x in os.getloadavg()], "runs": {n: [] for n in variants}}
    for i in range(args.repeats):
        for name, v in variants.items():
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--settings", json.dumps(v["settings"]),
                   "--batches", *map(str, args.batches), "--steps", str(args.steps), "--context", str(args.context),
                   "--requests", str(args.requests)]
            log(f"{name} #{i + 1} ({v['tree']}, {v['settings']}), load {os.getloadavg()[0]:.1f}")
            proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=v["tree"]), cwd=v["tree"], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                log(f"  failed: {proc.stderr[-1500:]}")
                res["runs"][name].append({"error": proc.stderr[-1500:]})
                continue
            r = json.loads(proc.stdout.splitlines()[-1])
            r["loadavg_end"] = round(os.getloadavg()[0], 2)
            res["runs"][name].append(r)
            log("  step ms " + ", ".join(f"b{b} {s['step_ms_median']:.2f}" for b, s in r["steps"].items())
                + (f"; churn copy bytes {r['churn']['copy_bytes_total']}" if r["churn"] else ""))
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res["summary"] = {}
    for name, runs in res["runs"].items():
        ok = [r for r in runs if "steps" in r]
        if ok:
            res["summary"][name] = {"paged_way": ok[-1].get("paged_way"), "churn": ok[-1]["churn"],
                                    "step_ms": {str(b): statistics.median(r["steps"][str(b)]["step_ms_median"]
                                                                          for r in ok) for b in args.batches},
                                    "step_ms_min": {str(b): min(r["steps"][str(b)]["step_ms_min"] for r in ok)
                                                    for b in args.batches}}
    files.write(res, markdown(res))
    log(f"wrote {files.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
