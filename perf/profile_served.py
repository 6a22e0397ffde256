"""Where single-stream served decode loses time against the in-process engine (GPU diagnostic).

Runs one request of `--max-tokens` tokens at a time through parallm-launch (raw ZeroMQ client)
and through the in-process Engine on the same random-weight model, and reports for each:
tok/s, the engine's own phase timings (schedule/prefill/launch/read per step) and, for the
served engine, the stage loop's split of each step (inbox, step, send, beat). In-process
variants isolate the suspects: the served engine's row limit (max_num_seqs), its EOS ids, the
per-step protocol work of the stage, and a second process holding the GPU.

    python -m perf.profile_served --shape llama-3.2-3b --tokenizer-dir DIR
        # -> perf/results/served-profile-llama-3.2-3b-h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import zmq

from perf.bench_gpu import SHAPES, build_model_dir, engine_stats, prompts, served, served_run, stats_delta
from perf.harness import Results, add_results_options


def engine_run(model, max_tokens: int, *, seed: int, max_num_seqs: int = 1, eos: list[int] | None = None,
               emulate_stage: bool = False, overlap: bool = True, profile: cProfile.Profile | None = None) -> dict:
    from parallm import protocol
    from parallm.config import Config, EngineConfig
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.protocol import SamplingParams
    from parallm.transport import Sender, open_socket
    from parallm.stages.engine import to_delta

    engine = Engine(EngineModel(model, tuple(eos or ()), 4096), Config(engine=EngineConfig(max_num_seqs=max_num_seqs, max_prefill_tokens=8192, max_prefill_rows=64, kv_budget_mb=24_000, overlap=overlap)))
    sender = sink = None
    if emulate_stage:
        ctx = zmq.Context.instance()
        sink = open_socket(ctx, zmq.PULL, "ipc:///tmp/profile-served-sink.sock", bind=True)
        sender = Sender(open_socket(ctx, zmq.PUSH, "ipc:///tmp/profile-served-sink.sock", bind=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(make_request(rid="r", prompt_ids=prompts(1, 128, seed)[0], params=params))
    tokens = 0
    first = None
    if profile is not None:
        profile.enable()
    while engine.has_work():
        outs = engine.step()
        if outs:
            tokens += sum(len(o.token_ids) for o in outs)
            first = first or time.perf_counter()
            if sender is not None:
                sender.send(protocol.StepOutputs(step=0, time=time.time(), batch_size=1,
                                                 outputs=[to_delta(o) for o in outs]))
                while sink.poll(0):
                    sink.recv()
    if profile is not None:
        profile.disable()
    end = time.perf_counter()
    stats = engine.stats()
    if sink is not None:
        sink.close(0)
        sender.close()
    return {"tok_s": tokens / (end - start), "ttft_s": first - start,
            "decode_ms_per_token": 1000 * (end - first) / max(1, tokens - 1),
            "step_ms_mean": stats.step_ms_mean, "steps": stats.steps}


def served_variant(model_dir: Path, max_tokens: int, max_num_seqs: int) -> dict[str, Any]:
    server = served(model_dir, max_num_seqs)
    try:
        asyncio.run(served_run(server.router, prompts(1, 128, 1), max_tokens, 1))
        before = asyncio.run(engine_stats(server.router))
        t0 = time.perf_counter()
        run = asyncio.run(served_run(server.router, prompts(1, 128, 2), max_tokens, 1))
        wall = time.perf_counter() - t0
        return {**run, "wall_s": wall, **stats_delta(before, asyncio.run(engine_stats(server.router)))}
    finally:
        server.stop()


def topology() -> str:
    """`nvidia-smi topo -m` (which CPUs and NUMA node the GPU is near), if available."""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    from parallm import blas

    if mx.default_device() == mx.cpu and not blas.is_preloaded() and blas.openblas_env() is not None:
        blas.reexec_with_openblas()  # on a CPU, the served engine has OpenBLAS: so must this one
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--served-max-seqs", default="256,1")
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-bench-gpu"))
    add_results_options(parser, default_help="the shape")
    args = parser.parse_args(argv)
    model_dir = build_model_dir(args.shape, args.work_dir / args.shape, args.tokenizer_dir)
    results = Results.from_args("served-profile", args, argv, experiment=args.shape)
    report: dict[str, Any] = {"shape": args.shape, "topology": topology(), "max_tokens": args.max_tokens,
                              "served": {}, "engine": {}}

    def save() -> None:
        results.write(report)

    for m in [int(x) for x in args.served_max_seqs.split(",") if x]:
        report["served"][f"max_num_seqs={m}"] = r = served_variant(model_dir, args.max_tokens, m)
        print("served", m, json.dumps(r), flush=True)
        save()
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    mx.eval(model.parameters())
    variants = {"default": {}, "max_num_seqs=256": {"max_num_seqs": 256}, "eos=[2]": {"eos": [2]},
                "stage_protocol": {"emulate_stage": True}, "no_overlap": {"overlap": False}}
    engine_run(model, args.max_tokens, seed=1)
    for name, opts in variants.items():
        engine_run(model, args.max_tokens, seed=1, **opts)
        report["engine"][name] = r = engine_run(model, args.max_tokens, seed=2, **opts)
        print("engine", name, json.dumps(r), flush=True)
        save()
    cpus = sorted(os.sched_getaffinity(0))
    for cpu in dict.fromkeys([cpus[0], cpus[len(cpus) // 2], cpus[-1]]):  # launch-bound: is it the core?
        os.sched_setaffinity(0, {cpu})
        try:
            engine_run(model, args.max_tokens, seed=1)
            report["engine"][f"pinned_cpu{cpu}"] = r = engine_run(model, args.max_tokens, seed=2)
        finally:
            os.sched_setaffinity(0, cpus)
        print("engine pinned", cpu, json.dumps(r), flush=True)
    save()
    holder = subprocess.Popen([sys.executable, "-c", "import mlx.core as mx, time; mx.eval(mx.ones(4) + 1); "
                               "print('holding', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    try:
        report["engine"]["second_gpu_process"] = r = engine_run(model, args.max_tokens, seed=2)
        print("engine second_gpu_process", json.dumps(r), flush=True)
    finally:
        holder.kill()
    profile = cProfile.Profile()
    engine_run(model, args.max_tokens, seed=2, profile=profile)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    report["engine_profile_top"] = text.getvalue()
    save()
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
