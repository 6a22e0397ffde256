"""The RL loop end to end: parallm-launch serving the default model with its supervised trainer
(GRPO, LoRA) on a built-in task; reports the reward curve and the step timings.

    PYTHONPATH=$PWD python -m perf.bench_train --config examples/train_length_cpu.toml
    # a served reward model as part of the reward (rl_training.reward_model; any reward model directory):
    PYTHONPATH=$PWD python -m perf.bench_train --reward-model DIR --reward-model-weight 0.5 --experiment rm

Writes perf/results/train[-EXPERIMENT]-DEVICE.json (every step's metrics line, the config, the
machine), .md and .png (reward mean ± std and completion length against the step).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from perf.harness import ROOT, Results, Server, add_results_options, describe


def run(config: str, steps: int | None, timeout_s: float, extra: list[str]) -> tuple[list[dict], dict]:
    from parallm.config import build_config

    work = Path(tempfile.mkdtemp(prefix="parallm-train-bench-"))
    args = ["--config", config, "--trainer.checkpointing.dir", str(work / "ckpt"), *extra]
    if steps:
        args += ["--trainer.rl-training.steps", str(steps)]
    planned = steps or build_config(file=config, environ={}).trainer.rl_training.steps
    metrics = work / "ckpt" / "metrics.jsonl"
    t0 = time.monotonic()
    with Server(*args, ready_timeout=600) as server:
        while True:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if len(lines) >= planned:
                break
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"only {len(lines)} of {planned} steps in {timeout_s:.0f} s:\n{server.output()}")
            time.sleep(2)
    rows = [json.loads(line) for line in lines]
    return rows, {"wall_s": round(time.monotonic() - t0, 1), "checkpoints": str(work / "ckpt")}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    mean = [r["reward_mean"] for r in rows]
    std = [r["reward_std"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax.plot(steps, mean, marker="o", ms=3, label="mean reward")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                    label="± std")
    if rows and rows[0].get("reward_model_mean") is not None:  # --reward-model: its own score too
        ax.plot(steps, [r["reward_model_mean"] for r in rows], marker="s", ms=3, label="reward model's score")
    else:
        ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("reward")
    ax.legend(loc="lower right")
    ax.set_title(title)
    ax2.plot(steps, [r["completion_len_mean"] for r in rows], marker="o", ms=3, color="tab:orange")
    ax2.set_ylabel("completion tokens (mean)")
    ax2.set_xlabel("GRPO step (= adapter version - 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples/train_length_cpu.toml"))
    parser.add_argument("--steps", type=int, default=None, help="override rl_training.steps")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--reward-model", help="a reward model directory, served beside the policy as 'rm' and used "
                        "as part of the reward (rl_training.reward_model)")
    parser.add_argument("--reward-model-weight", type=float, default=1.0)
    parser.add_argument("--task-reward-weight", type=float, default=1.0)
    parser.add_argument("--from-run", type=Path, metavar="DIR", help="report a finished run of this benchmark (its "
                        "parallm-train-bench-* directory: ckpt/metrics.jsonl) instead of training again")
    add_results_options(parser)
    args = parser.parse_args()
    extra = ["--pooling-model", f"rm:reward={args.reward_model}", "--trainer.rl-training.reward-model", "rm",
             "--trainer.rl-training.reward-model-weight", str(args.reward_model_weight),
             "--trainer.rl-training.task-reward-weight", str(args.task_reward_weight)] if args.reward_model else []
    if args.from_run:
        rows = [json.loads(line) for line in (args.from_run / "ckpt" / "metrics.jsonl").read_text().splitlines()]
        info = {"wall_s": round(rows[-1]["time"] - rows[0]["time"] + rows[0]["step_s"] + rows[0]["rollout_wait_s"], 1),
                "checkpoints": str(args.from_run / "ckpt"), "reported_from": str(args.from_run)}
    else:
        rows, info = run(args.config, args.steps, args.timeout, extra)
    first, last = rows[:5], rows[-5:]
    summary = {
        "reward_first5": sum(r["reward_mean"] for r in first) / len(first),
        "reward_last5": sum(r["reward_mean"] for r in last) / len(last),
        "step_s_mean": sum(r["step_s"] + r["rollout_wait_s"] for r in rows) / len(rows),
        "train_s_mean": sum(r["train_s"] for r in rows) / len(rows),
        "rollout_wait_s_mean": sum(r["rollout_wait_s"] for r in rows) / len(rows),
        "publish_ms_mean": 1000 * sum(r["publish_s"] for r in rows) / len(rows),
        "rollouts_dropped_stale": rows[-1]["rollouts_dropped_stale"],
    }
    judged = args.reward_model is not None
    if judged:
        summary["reward_model_first5"] = sum(r["reward_model_mean"] for r in first) / len(first)
        summary["reward_model_last5"] = sum(r["reward_model_mean"] for r in last) / len(last)
    results = Results.from_args("train", args)
    m = results.machine
    plot(rows, results.png, f"GRPO, length task, default model ({m['gpu'] or m['processor']}, {m['cpus']} CPUs)")
    lines = [f"# RL loop on {m['gpu'] or 'the CPU'}: GRPO + LoRA on the length task\n",
             f"Command: `{results.command}`  ",
             f"Machine: {describe(m)}; wall time {info['wall_s']} s for {len(rows)} steps.\n",
             f"Mean reward, first 5 steps: {summary['reward_first5']:.3f}; last 5: {summary['reward_last5']:.3f}.  ",
             f"Per step: {summary['step_s_mean']:.1f} s ({summary['rollout_wait_s_mean']:.1f} s waiting for rollouts, "
             f"{summary['train_s_mean']:.1f} s GRPO update, {summary['publish_ms_mean']:.1f} ms publish → served).\n"]
    if judged:
        lines += [f"Reward = {args.task_reward_weight:g} × the task's + {args.reward_model_weight:g} × the served "
                  f"reward model's ({args.reward_model}, served as `rm` beside the policy, one pool() batch per "
                  f"group over the trainer's ZeroMQ connection). Its own mean score, first 5 steps: "
                  f"{summary['reward_model_first5']:.3f}; last 5: {summary['reward_model_last5']:.3f}.\n"]
    lines += ["| step | version | reward mean | reward std | " + ("reward model mean | batches | " if judged else "")
              + "completion tokens | loss | step s |", "|---:|---:|---:|---:|" + ("---:|---:|" if judged else "")
              + "---:|---:|---:|"]
    for r in rows:
        judge = f"{r['reward_model_mean']:.3f} | {r['reward_model_batches']} | " if judged else ""
        lines.append(f"| {r['step']} | {r['version']} | {r['reward_mean']:.3f} | {r['reward_std']:.3f} | {judge}"
                     f"{r['completion_len_mean']:.1f} | {r['loss']:.4f} | {r['step_s'] + r['rollout_wait_s']:.1f} |")
    lines.append(f"\n![reward curve]({results.png.name})")
    results.write({"config": Path(args.config).read_text(), **info, "summary": summary, "steps": rows},
                  "\n".join(lines))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
