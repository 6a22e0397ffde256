"""perf/bench_engine.py's report: its results as markdown (every section's table, with the machine,
the BLAS and the repeats each section's numbers come from) and its plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from parallm import blas
from perf.harness import describe


def blas_description() -> str:
    if blas.is_preloaded():
        return f"OpenBLAS preloaded ({os.environ[blas.MARK]})"
    return "MLX wheel's reference BLAS (no preload)"


def section_repeats(res: dict[str, Any]) -> str:
    """Repeats per section as stored with its numbers (sections may come from different runs)."""
    out = []
    for key, name, pick in (("a_throughput", "a", lambda v: next(iter(v.values()))["parallm"]),
                            ("b_switches", "b", lambda v: next(iter(v.values()))["neither"]),
                            ("c_prefix", "c", lambda v: v),
                            ("d_dtype_blas", "d", lambda v: next(x for k, x in v.items() if k.startswith("batch"))["float32"])):
        if key in res:
            out.append(f"{name}: {pick(res[key])['repeats']}")
    return ", ".join(out)


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}"


def openblas_threads(machine: dict[str, Any]) -> str:
    return machine["env"].get("OPENBLAS_NUM_THREADS", "unset")


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    p = res["params"]
    lines = [
        "# Engine benchmark (CPU)",
        "",
        f"Machine: {describe(m)}.  ",
        f"Model: {res['model']['name']} ({res['model']['dtype']} unless stated), the same model object for parallm "
        f"and BatchGenerator; prompts of {p['prompt_tokens']} text tokens, fixed seeds, EOS suppressed.",
        "",
        "Runs that produced this file (a section run later replaces that section):",
        "",
    ]
    for r in res.get("runs", [{"command": res["command"], "sections": "all", "loadavg_start": res["loadavg_start"],
                               "loadavg_end": res["loadavg_end"]}]):
        lines.append(f"- `{r['command']}` (sections {r['sections']}; load average 1/5/15 min at start "
                     f"{r['loadavg_start']}, at end {r['loadavg_end']})")
    lines += [
        "",
        f"**The machine is shared with other work** (test suites and e2e servers of other engineers ran throughout: "
        f"the load averages above are on {m['cpus']} CPUs), so absolute figures are far below what an idle "
        "machine gives and single runs are noisy. Every figure is the median over repeats "
        f"({section_repeats(res)}); "
        "parallm and BatchGenerator runs (and the variants of b and d) are interleaved so they see the same load; "
        "raw values per repeat are in the JSON. Decode tok/s = tokens generated after every sequence had its first "
        "token, over that interval; end-to-end (e2e) includes prefill.",
        "",
    ]
    a = res.get("a_throughput")
    if a:
        lines += [f"## a. Engine vs mlx-lm BatchGenerator ({res['params']['max_tokens']} output tokens per sequence)", "",
                  "| batch | parallm e2e tok/s | BatchGenerator e2e tok/s | parallm decode tok/s | "
                  "BatchGenerator decode tok/s | ratio decode | ratio e2e |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for b, r in a.items():
            lines.append(f"| {b} | {fmt(r['parallm']['e2e_tok_s'])} | {fmt(r['batchgen']['e2e_tok_s'])} | "
                         f"{fmt(r['parallm']['decode_tok_s'])} | {fmt(r['batchgen']['decode_tok_s'])} | "
                         f"{fmt(r['ratio_decode'], 2)}x | {fmt(r['ratio_e2e'], 2)}x |")
        lines.append("")
    b = res.get("b_switches")
    if b:
        lines += [f"## b. overlap and compile (sampled, temperature 0.8, fixed seeds, {res['params']['switch_tokens']} "
                  "output tokens)", "",
                  "| batch | both on | overlap only | compile only | neither | overlap gain | compile gain |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for bs, r in b.items():
            lines.append(f"| {bs} | {fmt(r['overlap+compile']['decode_tok_s'])} | {fmt(r['overlap']['decode_tok_s'])} | "
                         f"{fmt(r['compile']['decode_tok_s'])} | {fmt(r['neither']['decode_tok_s'])} | "
                         f"{fmt(r['gain_overlap'], 3)}x | {fmt(r['gain_compile'], 3)}x |")
        lines += ["", "(decode tok/s; gains are relative to neither.)", ""]
    c = res.get("c_prefix")
    if c:
        lines += ["## c. Prefix cache: time to first token", "",
                  f"{res['params']['prefix_tokens']}-token shared prefix + {res['params']['suffix_tokens']}-token "
                  "distinct suffix, max_prefill_tokens 512, block size 16.", "",
                  "| cold TTFT | prefix-hit TTFT | hit/cold | prefix_hit_tokens | prompt tokens computed on hit |",
                  "|---:|---:|---:|---:|---:|",
                  f"| {fmt(c['cold_ttft_s'] * 1000)} ms | {fmt(c['hit_ttft_s'] * 1000)} ms | {fmt(c['ratio'], 3)}x | "
                  f"{int(c['prefix_hit_tokens'])} | {int(c['prompt_tokens_computed_hit'])} |", ""]
    d = res.get("d_dtype_blas")
    if d:
        lines += [f"## d. dtype and BLAS ({p['dtype_prompt_tokens']}-token prompts, {p['dtype_tokens']} output tokens)", "",
                  "| batch | float32 decode tok/s | quantized decode tok/s | float32/quantized |",
                  "|---:|---:|---:|---:|"]
        for key in [k for k in d if k.startswith("batch")]:
            r = d[key]
            lines.append(f"| {key[5:]} | {fmt(r['float32']['decode_tok_s'])} | {fmt(r['quantized']['decode_tok_s'])} | "
                         f"{fmt(r['float32_over_quantized_decode'], 2)}x |")
        t, ref = d["tiny_openblas"], d["tiny_reference_blas"]
        w = t["workload"]
        lines += ["", f"float32, batch {w['batch']}, {w['prompt_tokens']}-token prompts, {w['max_tokens']} output tokens:", "",
                  "| BLAS | e2e tok/s | decode tok/s | wall s |", "|---|---:|---:|---:|",
                  f"| OpenBLAS, OPENBLAS_NUM_THREADS={openblas_threads(m)} | {fmt(t['e2e_tok_s'], 2)} | {fmt(t['decode_tok_s'], 2)} | {fmt(t['wall_s'], 2)} |"]
        dt = d.get("tiny_openblas_default_threads", {})
        if "decode_tok_s" in dt:
            lines.append(f"| OpenBLAS, one thread per core (its default; child) | {fmt(dt['e2e_tok_s'], 2)} | "
                         f"{fmt(dt['decode_tok_s'], 2)} | {fmt(dt['wall_s'], 2)} |")
        if "decode_tok_s" in ref:
            lines += [f"| reference BLAS (child, {ref['repeats']} repeats) | {fmt(ref['e2e_tok_s'], 2)} | "
                      f"{fmt(ref['decode_tok_s'], 2)} | {fmt(ref['wall_s'], 2)} |", "",
                      f"OpenBLAS speedup: {fmt(d['openblas_speedup_decode'])}x decode, "
                      f"{fmt(d['openblas_speedup_e2e'])}x end to end."]
        else:
            lines.append(f"| reference BLAS | {ref} | | |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    a = res.get("a_throughput")
    if not a:
        return
    batches = list(a)
    x = range(len(batches))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [a[b]["parallm"]["decode_tok_s"] for b in batches], w, label="parallm Engine")
    ax.bar([i + w / 2 for i in x], [a[b]["batchgen"]["decode_tok_s"] for b in batches], w,
           label="mlx-lm BatchGenerator")
    ax.set_xticks(list(x), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title(f"SmolLM2-135M float32, {res['machine']['cpus']} CPU cores, OpenBLAS")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
