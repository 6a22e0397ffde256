"""Rollout throughput against update time at several `engine.training_share` values (issue 33 item 5):
parallm-launch with its supervised trainer (GRPO, LoRA, the length task), one server run per share.

    PYTHONPATH=$PWD python -m perf.bench_train_share --shares 0,0.5,0.75 --steps 6
    # a GPU: a random-weight shape with a real tokenizer, trained on perf/train_tasks.py's VowelShareTask
    # (a random model never stops, so the length task would give every reply 0; the timings are what counts)
    python -m perf.bench_train_share --shape llama-3.2-1b --tokenizer-dir TOK --work-dir W --shares 0,0.5,0.75

The engine rests after each step while the trainer's update runs (engine/device_share.py), so the update
should take less time and the rollouts sampled meanwhile fewer tokens per second. The first step of each
run (compiles, first loads) is left out of the means. Writes perf/results/train-share-DEVICE.json and .md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from perf.bench_train import run
from perf.harness import ROOT, Results, add_results_options, describe


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples/train_length_cpu.toml"))
    parser.add_argument("--shares", default="0,0.5,0.75")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--shape", help="serve and train a random-weight model of this shape (parallm/models/shapes.py)")
    parser.add_argument("--tokenizer-dir", type=Path, help="with --shape: the tokenizer it borrows")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-train-share"))
    parser.add_argument("--server-args", default="", help="more parallm-launch arguments for every run")
    add_results_options(parser)
    args = parser.parse_args()
    extra = args.server_args.split()
    if args.shape:
        from transformers import AutoTokenizer

        from parallm.models.shapes import build_model_dir

        vocab = len(AutoTokenizer.from_pretrained(args.tokenizer_dir))
        model = build_model_dir(args.shape, args.work_dir / args.shape, args.tokenizer_dir, vocab_size=vocab)
        extra += ["--model.path", str(model), "--trainer.rl-training.task", "perf.train_tasks:VowelShareTask"]
    runs = []
    for share in [float(s) for s in args.shares.split(",")]:
        rows, info = run(args.config, args.steps, args.timeout, [*extra, "--engine.training-share", str(share)])
        kept = rows[1:] or rows
        runs.append({"share": share, "wall_s": info["wall_s"], "steps": rows,
                     "train_s": mean(kept, "train_s"), "rollout_tokens_per_s": mean(kept, "rollout_tokens_per_s"),
                     "rollout_wait_s": mean(kept, "rollout_wait_s"),
                     "step_s": mean(kept, "step_s") + mean(kept, "rollout_wait_s"),
                     "reward_mean": mean(kept, "reward_mean")})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "steps"}))
    results = Results.from_args("train-share", args)
    m = results.machine
    base = runs[0]
    lines = [f"# The device's share left to training, {m['gpu'] or 'the CPU'}\n",
             f"Command: `{results.command}`  ",
             f"Machine: {describe(m)}. Model: {args.shape or 'the default model'}; {args.steps} steps per share, "
             "the first left out of the means.\n",
             "The engine rests step x s / (1 - s) after each step while the trainer's update runs "
             "(`engine.training_share` s). Rollout tok/s: tokens per second of the groups the trainer received "
             "(sampled while the previous update ran, max_staleness 1); update s: the GRPO update; step s: update "
             "plus waiting for rollouts.\n",
             "| share | update s | vs share 0 | rollout tok/s | vs share 0 | waiting for rollouts s | step s | run s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['share']:g} | {r['train_s']:.2f} | {r['train_s'] / base['train_s']:.2f}x | "
                     f"{r['rollout_tokens_per_s']:.1f} | "
                     f"{r['rollout_tokens_per_s'] / base['rollout_tokens_per_s'] if base['rollout_tokens_per_s'] else 0:.2f}x"
                     f" | {r['rollout_wait_s']:.2f} | {r['step_s']:.2f} | {r['wall_s']:.0f} |")
    results.write({"config": Path(args.config).read_text(), "shape": args.shape, "runs": runs}, "\n".join(lines))


if __name__ == "__main__":
    main()
