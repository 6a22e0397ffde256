"""The trainer's resident memory with QLoRA (the base kept 4-bit) against a float copy of the same
base (what the trainer loaded before issue 33), on a random-weight 4-bit model of a given shape.

Each variant runs in a fresh process: load the policy (parallm.training.policy.load_policy) in the
dtype, log the memory plan (parallm.training.memory), then take GRPO updates on `--seqs` sequences of
`--seq-len` tokens; it reports the process's peak RSS, MLX's peak allocation (on a GPU: device
memory), the load time and the update time, beside the plan's estimate.

    PYTHONPATH=$PWD python -m perf.bench_train_memory --shape llama-3.2-1b-4bit       # CPU: quantized vs float32
    PYTHONPATH=$PWD python -m perf.bench_train_memory --shape qwen3-8b --dtypes quantized,bfloat16   # H200
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from perf.harness import Results, add_results_options


def variant(model_dir: str, dtype: str, seqs: int, seq_len: int, steps: int, checkpoint: str) -> dict:
    """One measurement in this process (called through `--child`)."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from parallm.config import LoRATrainConfig, ModelConfig
    from parallm.training.grpo import GRPOUpdater, LossConfig, Sample
    from parallm.training.memory import checkpoint_layers, make_plan, model_shape
    from parallm.training.policy import load_policy

    t0 = time.perf_counter()
    lora = LoRATrainConfig(rank=8, num_layers=-1, keys=["self_attn.q_proj", "self_attn.v_proj"])
    policy = load_policy(ModelConfig(path=model_dir, dtype=dtype), lora)
    load_s = time.perf_counter() - t0
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad_checkpoint = None if checkpoint == "auto" else checkpoint == "on"
    plan = make_plan(policy.model, trainable=policy.trainable_count(), seq_len=seq_len, micro_batch=seqs,
                     grad_checkpoint=grad_checkpoint)
    if plan.grad_checkpoint:
        checkpoint_layers(policy.model)
    updater = GRPOUpdater(policy.model, optim.Adam(learning_rate=1e-4), LossConfig(), micro_batch=seqs)
    prompt = 32
    samples = [Sample(prompt_ids=list(range(1, prompt + 1)), completion_ids=list(range(100 + i, 100 + i + seq_len - prompt)),
                      sampler_logprobs=[-11.0] * (seq_len - prompt), advantage=1.0 if i % 2 else -1.0)
               for i in range(seqs)]
    mx.reset_peak_memory()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        updater.step(samples)
        times.append(time.perf_counter() - t)
    return {"dtype": dtype, "trainer_dtype": policy.dtype, "load_s": round(load_s, 1),
            "update_s": round(min(times), 2) if times else None, "rss_loaded_mb": round(rss_loaded / 2 ** 20),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "mlx_peak_mb": round(mx.get_peak_memory() / 2 ** 20),
            "plan": {"weights_mb": round(plan.weights / 2 ** 20), "optimizer_mb": round(plan.optimizer / 2 ** 20, 1),
                     "activations_mb": round(plan.activations / 2 ** 20), "total_mb": round(plan.trainer_total / 2 ** 20),
                     "grad_checkpoint": plan.grad_checkpoint},
            "trainable": policy.trainable_count(), "params": model_shape(policy.model).params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b-4bit")
    ap.add_argument("--dtypes", default="quantized,float32")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="GRPO updates measured (0: the load alone)")
    ap.add_argument("--grad-checkpoint", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer files (default: the default model's)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-train-memory"))
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "DTYPE"), help=argparse.SUPPRESS)
    add_results_options(ap, "memory")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(variant(args.child[0], args.child[1], args.seqs, args.seq_len, args.steps,
                                 args.grad_checkpoint)))
        return
    from parallm import blas

    blas.reexec_with_openblas()
    from perf.bench_gpu import build_model_dir

    tokenizer = args.tokenizer_dir
    if tokenizer is None:
        from parallm.config import ModelConfig
        from parallm.models import resolve_model

        tokenizer = resolve_model(ModelConfig()).path
    model_dir = build_model_dir(args.shape, args.work_dir / args.shape, Path(tokenizer))
    rows = []
    for dtype in args.dtypes.split(","):
        cmd = [sys.executable, "-m", "perf.bench_train_memory", "--child", str(model_dir), dtype, "--seqs",
               str(args.seqs), "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--grad-checkpoint",
               args.grad_checkpoint]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:   # recorded, not fatal: a float copy of a large model may not fit the machine
            why = (f"killed by signal {-done.returncode} (the OOM killer, on a shared machine)" if done.returncode < 0
                   else f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
            rows.append({"dtype": dtype, "failed": why})
            print(f"{dtype}: {why}", flush=True)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    work = (f"GRPO updates of {args.seqs} sequences x {args.seq_len} tokens (one micro-batch)" if args.steps else
            "the load alone (no update: peak RSS = after load; the plan's activations are for "
            f"{args.seqs} x {args.seq_len} tokens)")
    lines = [f"# Trainer memory, QLoRA vs a float copy ({args.shape}, random weights)", "",
             f"LoRA rank 8 on q/v of every layer; {work}, gradient checkpointing {args.grad_checkpoint}; a fresh "
             "process per row.", "",
             "| base dtype | peak RSS MiB | RSS after load MiB | MLX peak MiB | plan: weights / adapter+Adam / activations "
             "MiB | load s | update s |", "|---|---:|---:|---:|---|---:|---:|"]
    params = next((r["params"] for r in rows if "params" in r), 0)
    for r in rows:
        if "failed" in r:
            size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(r["dtype"], 0)
            computed = f"; its weights alone would be {params * size / 2 ** 20:,.0f} MiB" if size and params else ""
            lines.append(f"| {r['dtype']} | not measured: {r['failed']}{computed} | | | | | |")
            continue
        p = r["plan"]
        lines.append(f"| {r['trainer_dtype']} | {r['rss_peak_mb']:,} | {r['rss_loaded_mb']:,} | {r['mlx_peak_mb']:,} | "
                     f"{p['weights_mb']:,} / {p['optimizer_mb']} / {p['activations_mb']:,} "
                     f"(ckpt {'on' if p['grad_checkpoint'] else 'off'}) | {r['load_s']} | {r['update_s'] or '-'} |")
    results = Results.from_args("train", args)
    results.write({"shape": args.shape, "seqs": args.seqs, "seq_len": args.seq_len, "rows": rows}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
