"""Several supervised trainers at once (issue 33): parallm-launch serving the default model with one
trainer per `[[trainer]]` entry, each its own adapter and task; reports every trainer's reward curve.

    PYTHONPATH=$PWD python -m perf.bench_train_multi --config examples/train_two_cpu.toml
    PYTHONPATH=$PWD python -m perf.bench_train_multi --from-run /tmp/parallm-train-multi-XXXX   # report a run again

The server runs in a fresh work directory, so the entries' relative checkpoint directories start empty
there. Writes perf/results/train-multi-DEVICE.json (every trainer's metrics lines), .md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from perf.harness import ROOT, Results, Server, add_results_options, describe


def run(config: Path, timeout_s: float) -> tuple[dict[str, list[dict]], float]:
    from parallm.config import build_config, enabled_trainers

    trainers = enabled_trainers(build_config(file=config, environ={}))
    work = Path(tempfile.mkdtemp(prefix="parallm-train-multi-"))
    paths = {t.name: work / (t.checkpointing.metrics_file or Path(t.checkpointing.dir) / "metrics.jsonl")
             for t in trainers}
    planned = {t.name: t.rl_training.steps for t in trainers}
    here = os.getcwd()
    os.chdir(work)   # the entries' relative checkpoint directories: under the work directory
    t0 = time.monotonic()
    try:
        with Server("--config", str(config), ready_timeout=600) as server:
            while True:
                rows = {name: [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
                        for name, p in paths.items()}
                if all(len(rows[n]) >= planned[n] for n in rows):
                    break
                if time.monotonic() - t0 > timeout_s:
                    raise SystemExit(f"steps {({n: len(r) for n, r in rows.items()})} of {planned} in "
                                     f"{timeout_s:.0f} s:\n{server.output()}")
                time.sleep(2)
    finally:
        os.chdir(here)
    return rows, round(time.monotonic() - t0, 1)


def finished(config: Path, work: Path) -> tuple[dict[str, list[dict]], float]:
    """The metrics of a run that ended (e.g. before its report was written), from its work directory."""
    from parallm.config import build_config, enabled_trainers

    rows = {t.name: [json.loads(line) for line in
                     (work / (t.checkpointing.metrics_file or Path(t.checkpointing.dir) / "metrics.jsonl"))
                     .read_text().splitlines()]
            for t in enabled_trainers(build_config(file=config, environ={}))}
    first = min(r[0]["time"] - r[0]["step_s"] - r[0]["rollout_wait_s"] for r in rows.values())
    return rows, round(max(r[-1]["time"] for r in rows.values()) - first, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "examples/train_two_cpu.toml")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--from-run", type=Path, metavar="DIR", help="report a finished run of this benchmark (its "
                        "parallm-train-multi-* directory) instead of training again")
    add_results_options(parser, "multi")
    args = parser.parse_args()
    if args.from_run:
        rows, wall = finished(args.config.resolve(), args.from_run)
    else:
        rows, wall = run(args.config.resolve(), args.timeout)
    results = Results.from_args("train", args)
    summary = {name: {"reward_first5": sum(r["reward_mean"] for r in rs[:5]) / len(rs[:5]),
                      "reward_last5": sum(r["reward_mean"] for r in rs[-5:]) / len(rs[-5:]),
                      "adapter_versions": [rs[0]["version"], rs[-1]["version"]]} for name, rs in rows.items()}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rs in rows.items():
        ax.plot([r["step"] for r in rs], [r["reward_mean"] for r in rs], marker="o", ms=3, label=name)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right")
    ax.set_title("two trainers at once, default model (CPU)")
    fig.tight_layout()
    fig.savefig(results.png, dpi=120)
    m = results.machine
    lines = [f"# Several trainers at once on {m['gpu'] or 'the CPU'}\n", f"Command: `{results.command}`  ",
             f"Machine: {describe(m)}; wall time {wall} s.\n",
             "| trainer | mean reward, first 5 steps | last 5 | adapter versions |", "|---|---:|---:|---|"]
    lines += [f"| {n} | {s['reward_first5']:.3f} | {s['reward_last5']:.3f} | {s['adapter_versions'][0]} -> "
              f"{s['adapter_versions'][1]} |" for n, s in summary.items()]
    names = list(rows)
    lines += ["", "| step | " + " | ".join(f"{n} reward" for n in names) + " |", "|---:|" + "---:|" * len(names)]
    for i in range(max(len(r) for r in rows.values())):
        lines.append(f"| {i + 1} | " + " | ".join(f"{rows[n][i]['reward_mean']:.3f}" if i < len(rows[n]) else ""
                                                   for n in names) + " |")
    lines.append(f"\n![reward curves]({results.png.name})")
    results.write({"config": args.config.read_text(), "wall_s": wall, "summary": summary, "trainers": rows},
                  "\n".join(lines))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
