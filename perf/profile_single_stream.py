"""What the served single stream's engine step pays that the in-process step does not (issue 37, item 3).

On a GPU the one-row decode step is host work: the engine thread's Python, MLX's graph building and the
kernel launches. The H200 figures disagree by ~2 ms a step between `perf/profile_decode.py` (3.8 ms,
greedy, no EOS handling) and the served engine of `perf/bench_serving.py` c=1 (7 ms: its requests ban the
EOS ids by `logit_bias`, as mlx_lm.server needs) while `perf/bench_single_stream.py`'s served engine
(`ignore_eos`) stepped in 4.5 ms. This script runs one row's decode steps in one process, the variants
alternated round by round so that the machine's drift falls on all of them alike:

- `plain`: greedy, `ignore_eos` (profile_decode's and bench_single_stream's request);
- `bias`: greedy with the EOS ids banned by `logit_bias` (bench_serving's and mlx_lm.server's way);
- `stage`: `plain` plus what the engine stage does per step beside the step (stages/engine.py `send`:
  the outputs as `SeqDelta`s, one `StepOutputs` encoded and pushed over ZeroMQ to a PULL socket that a
  child process drains, as the detokenizer does), so the ZeroMQ I/O thread wakes every step;
- `stage_bias`: both.

For each: ms per step (wall), the engine's phases (schedule / launch / read), the CPU ms per step of every
thread of this process that used any (/proc/self/task: the engine thread, MLX's and ZeroMQ's) and the engine
thread's context switches per step (a wake-up it waited for, or a preemption).
Tokens of every variant are checked against `plain`'s.

    python -m perf.profile_single_stream --shape tiny-deep --steps 300 --rounds 3     # CPU
    bash perf/gpu_runs.sh single37      # llama-3.2-3b on the GPU, this tree and .gpu/base alternating
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "bias", "stage", "stage_bias")
SINK = ("import sys, zmq\nctx = zmq.Context()\ns = ctx.socket(zmq.PULL)\ns.bind(sys.argv[1])\nprint('ready', flush=True)\n"
        "while True:\n    s.recv()\n")


def thread_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (OS thread name, CPU seconds so far) of every thread of this process (/proc; {} without)."""
    out = {}
    base = "/proc/self/task"
    if not os.path.isdir(base):
        return out
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{tid}/schedstat") as f:
                out[int(tid)] = (name, int(f.read().split()[0]) / 1e9)
        except OSError:
            continue
    return out


def switches() -> tuple[int, int]:
    """(voluntary, involuntary) context switches of this thread so far (/proc; (0, 0) without)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            text = f.read()
    except OSError:
        return 0, 0
    counts = dict(line.split(":", 1) for line in text.splitlines() if line.endswith(tuple("0123456789")) and ":" in line)
    return int(counts.get("voluntary_ctxt_switches", 0)), int(counts.get("nonvoluntary_ctxt_switches", 0))


def thread_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], steps: int,
                 main: int) -> dict[str, float]:
    """CPU ms per step of each thread that used at least 0.005 ms a step (`main`: the engine thread)."""
    out = {}
    for tid, (name, cpu) in after.items():
        ms = 1000 * (cpu - before.get(tid, (name, 0.0))[1]) / steps
        if ms >= 0.005:
            out[f"{'main' if tid == main else name}/{tid}"] = round(ms, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class Stage:
    """The engine stage's per-step send (stages/engine.py EngineStage.send) to a draining child process."""

    def __init__(self) -> None:
        import zmq

        from parallm.transport import Sender, open_socket

        self.address = f"ipc://{tempfile.mkdtemp(prefix='parallm-single-')}/sink.sock"
        self.child = subprocess.Popen([sys.executable, "-c", SINK, self.address], stdout=subprocess.PIPE, text=True)
        self.child.stdout.readline()
        self.ctx = zmq.Context()
        self.sender = Sender(open_socket(self.ctx, zmq.PUSH, self.address, bind=False))
        self.step = 0

    def send(self, outputs: list) -> None:
        from parallm import protocol
        from parallm.stages.engine_replies import to_delta

        self.step += 1
        deltas = [to_delta(o) for o in outputs]
        if deltas:
            self.sender.send(protocol.StepOutputs(step=self.step, time=time.time(), batch_size=1, outputs=deltas))

    def close(self) -> None:
        self.sender.sock.close(0)
        self.ctx.term()
        self.child.kill()
        self.child.wait()


def run_variant(engine: Any, name: str, ids: list[int], steps: int, eos: list[int], stage: Stage | None,
                rid: str) -> dict[str, Any]:
    """One request of `steps` + 8 tokens through `engine` the way `name` says; the steady steps timed."""
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    import mlx.core as mx

    bias = name.endswith("bias")
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=not bias,
                            logit_bias={t: -100.0 for t in eos} if bias else {})
    engine.add_request(make_request(rid=rid, prompt_ids=ids, params=params))
    tokens: list[int] = []

    def send(outs: list) -> None:  # the stage sends what a step's prefill pass emits, then what it returns
        for o in outs:
            tokens.extend(o.token_ids)
        if stage is not None and name.startswith("stage"):
            stage.send(outs)

    def step() -> None:
        send(engine.step(emit=send))

    for _ in range(4):  # the prefill and the first decode steps
        step()
    before, cpu0, cs0, t0 = engine.stats(), thread_cpu(), switches(), time.perf_counter()
    for _ in range(steps):
        step()
    mx.synchronize()
    wall, cpu1, cs1, after = time.perf_counter() - t0, thread_cpu(), switches(), engine.stats()
    while engine.has_work():
        step()
    phases = {k: round((v * after.steps - before.step_ms_mean.get(k, 0.0) * before.steps) / steps, 4)
              for k, v in after.step_ms_mean.items()}
    return {"step_ms": round(1000 * wall / steps, 4), "phases_ms": phases,
            "thread_cpu_ms": thread_delta(cpu0, cpu1, steps, os.getpid()), "tokens": tokens,
            "engine_thread_switches": [round((b - a) / steps, 2) for a, b in zip(cs0, cs1)]}


def main(argv: list[str] | None = None) -> int:
    from perf.harness import Results, add_results_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny-deep")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--tokenizer-dir", default="")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--server-args", default="", help="parallm-launch engine settings the engine is built with")
    parser.add_argument("--label", default="", help="a name for this tree in the results (e.g. base, head)")
    add_results_options(parser)
    args = parser.parse_args(argv)

    import mlx.core as mx

    from parallm import blas

    if mx.default_device() == mx.cpu:  # as the supervisor does for the engine stage
        blas.reexec_with_openblas()
    from parallm.config.loading import parse_args
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model
    from perf.bench_serving import shape_model_dir
    from perf.bench_single_stream import prompt_ids

    model_dir = shape_model_dir(args)
    config = parse_args(["--model.path", str(model_dir), "--model.served-name", "bench", *args.server_args.split()])
    config = config[0] if isinstance(config, tuple) else config
    loaded = load_model(config.model)
    engine = Engine(EngineModel.of(loaded), config)
    engine.warm_up()
    eos = list(engine.eos_token_ids)
    ids = prompt_ids(args.prompt_len, engine.vocab_size)
    variants = [v for v in args.variants.split(",") if v]
    stage = Stage() if any(v.startswith("stage") for v in variants) else None
    results = Results.from_args("single-stream-profile", args, argv)
    rows: list[dict[str, Any]] = []
    reference: list[int] | None = None
    try:
        run_variant(engine, "plain", ids, 16, eos, stage, "warm")
        for r in range(args.rounds):
            for name in (variants if r % 2 == 0 else variants[::-1]):
                row = run_variant(engine, name, ids, args.steps, eos, stage, f"{name}-{r}")
                tokens = row.pop("tokens")
                reference = reference or tokens
                row.update(round=r, variant=name, same_tokens=tokens == reference)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if stage is not None:
            stage.close()
    summary = {v: round(statistics.median(r["step_ms"] for r in rows if r["variant"] == v), 4) for v in variants}
    report = {"label": args.label, "shape": args.shape, "steps": args.steps, "eos": eos,
              "settings": {k: v for k, v in engine.stats().settings.items()} if isinstance(engine.stats().settings, dict)
              else None, "median_step_ms": summary, "rows": rows}
    lines = [f"# One row's decode step, in process ({args.shape}, {args.steps} steps a variant, {args.rounds} rounds"
             f"{', ' + args.label if args.label else ''})", "",
             "| round | variant | step ms | launch ms | read ms | engine thread CPU ms | its context switches "
             "(voluntary / involuntary) | other threads' CPU ms | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cpu = row["thread_cpu_ms"]
        main_ms = sum(v for k, v in cpu.items() if k.startswith("main/"))
        cs = row["engine_thread_switches"]
        others = ", ".join(f"{k.split('/')[0]} {v:.3f}" for k, v in cpu.items() if not k.startswith("main/"))
        lines.append(f"| {row['round']} | {row['variant']} | {row['step_ms']:.3f} | {row['phases_ms'].get('launch', 0):.3f} "
                     f"| {row['phases_ms'].get('read', 0):.3f} | {main_ms:.3f} | {cs[0]} / {cs[1]} | {others} | {row['same_tokens']} |")
    lines += ["", "Medians: " + ", ".join(f"{k} {v:.3f} ms" for k, v in summary.items())]
    results.write(report, "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {results.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
