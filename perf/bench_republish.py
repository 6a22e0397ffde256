"""One engine, every request under one adapter, with a new version published every few steps
(a trainer publishing while rollouts run) and without: what republishing costs.

    python -m perf.bench_republish [--shape tiny] [--rows 64] [--every 4] [--baseline-tree DIR]

In-process engine, closed loop: `rows` requests run at once, each replaced as it finishes
(max_tokens spread so that rows finish on different steps and move, as served rows do), all
naming adapter "pol" (rank-16 LoRA on q_proj and o_proj of every layer, factored: the CPU
default). Phases, each from a fresh set of requests: `still` (no publish: one version) and
`republish` (a new version every `--every` steps; requests keep the version they started under,
so a batch holds several). Per phase: output tokens/s, the process's CPU per output token,
steps, packed passes (prompt chunks riding in the decode pass), mean decode batch, adapter passes
by kind and the mixed-batch stack sets built.

`--baseline-tree DIR` (a checkout of another commit, e.g. `git archive HEAD~1 parallm | tar -x
-C DIR`) runs the same phases with that tree's `parallm`, interleaved with this tree's, each
round a fresh process per tree. Writes perf/results/republish[-EXPERIMENT]-DEVICE.{json,md}.
On a GPU the served figure is `bash perf/gpu_runs.sh republish` (perf/bench_parallel.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _model(shape: str):
    import mlx.core as mx

    if not shape:
        from parallm.config import ModelConfig
        from parallm.models import load_model

        loaded = load_model(ModelConfig(dtype="float32"))
        return loaded.model, loaded.vocab_size, "SmolLM2-135M (default), float32"
    import importlib

    from perf.bench_gpu import SHAPES

    spec = dict(SHAPES[shape])
    dtype = spec.pop("dtype")
    arch = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(spec))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, spec["vocab_size"], f"random weights of the {shape} shape, {dtype}"


def child(args: argparse.Namespace) -> dict:
    """Both phases in this process, with whichever `parallm` is on the path."""
    import parallm
    from parallm.adapters import lora
    from parallm.config import AdaptersConfig, Config, EngineConfig
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.protocol import SamplingParams
    from perf.bench_adapters import lora_blob

    model, vocab, described = _model(args.shape)
    blobs = [lora_blob(model, 16, k, targets=("self_attn.q_proj", "self_attn.o_proj")) for k in range(4)]
    engine = Engine(EngineModel(model, (), 4096, vocab),
                    Config(engine=EngineConfig(max_num_seqs=args.rows, prefix_cache=False, kv_budget_mb=args.kv_budget_mb),
                           adapters=AdaptersConfig(merge_mb=0, history=64)))
    sets = [0]
    new_stacks = lora._Stacks.__init__

    def counted(self, slots) -> None:  # lora._Stacks.__init__, counting the sets built
        sets[0] += 1
        new_stacks(self, slots)

    lora._Stacks.__init__ = counted
    ids = itertools.count()
    publishes = itertools.count()

    def publish() -> None:
        config, blob = blobs[next(publishes) % len(blobs)]
        engine.load_adapter("pol", config=config, weights=blob)

    def top_up() -> None:
        while len(engine.request_ids()) < args.rows:
            i = next(ids)
            prompt = [(i * 7919 + j * 104729) % (vocab - 10) + 5 for j in range(args.prompt_len)]
            engine.add_request(make_request(rid=f"r{i}", prompt_ids=prompt, adapter="pol", params=SamplingParams(
                temperature=0.0, max_tokens=args.tokens // 2 + (i * 37) % args.tokens, ignore_eos=True)))

    def phase(every: int) -> dict:
        for rid in engine.request_ids():
            engine.abort(rid)
        while engine.has_work():
            engine.step()
        publish()
        for s in range(args.warm):
            top_up()
            engine.step()
        st0, sets0 = engine.stats(), sets[0]
        hist0 = st0.decode_batch_hist
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(args.steps):
            top_up()
            if every and s % every == every - 1:
                publish()
            engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        st = engine.stats()
        tokens = st.generated_tokens - st0.generated_tokens
        hist = {k: v - hist0.get(k, 0) for k, v in st.decode_batch_hist.items()}
        return {"tok_per_s": round(tokens / wall, 1), "cpu_us_per_token": round(1e6 * cpu / tokens, 1),
                "step_ms": round(1e3 * wall / args.steps, 2), "tokens": tokens,
                "packed_passes": st.mixed_passes - st0.mixed_passes,
                "mean_decode_batch": round(sum(k * v for k, v in hist.items()) / max(1, sum(hist.values())), 1),
                "adapter_passes": {k: v - st0.adapters.passes.get(k, 0) for k, v in st.adapters.passes.items()},
                "stack_sets_built": sets[0] - sets0}

    phase(0)  # warm-up: first traces, buffers
    out = {"parallm": str(Path(parallm.__file__).parent), "model": described}
    for name, every in (("still", 0), ("republish", args.every)):
        out[name] = phase(every)
    return out


def report(res: dict, command: str) -> str:
    lines = ["# Republishing an adapter while its rows run (in-process engine)", "", f"Command: `{command}`  ",
             (f"Model: {res['model']}; {res['rows']} rows, LoRA rank 16 on q_proj+o_proj, a new version every "
              f"{res['every']} steps in `republish`; load average at start {res['loadavg_at_start']}, "
              f"at end {res['loadavg_at_end']}."), "",
             ("| round | tree | phase | tok/s | CPU us/token | step ms | mean decode batch | packed passes | "
              "mixed passes | stack sets built |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        for phase in ("still", "republish"):
            p = r[phase]
            lines.append(f"| {r['round']} | {r['tree']} | {phase} | {p['tok_per_s']} | {p['cpu_us_per_token']} | "
                         f"{p['step_ms']} | {p['mean_decode_batch']} | {p['packed_passes']} | "
                         f"{p['adapter_passes'].get('mixed', 0)} | {p['stack_sets_built']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from parallm import blas

    if not blas.is_preloaded() and blas.openblas_env() is not None:
        blas.reexec_with_openblas()  # MLX's Linux CPU wheel links a reference BLAS ~15-60x slower
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", help="a perf.bench_gpu shape (random weights); '' = the default model")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens spread over [tokens/2, 1.5 tokens)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--every", type=int, default=4, help="steps between versions in the republish phase")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-budget-mb", type=int, default=1024)
    ap.add_argument("--baseline-tree", type=Path, help="a tree whose parallm runs interleaved with this one's")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    from perf.harness import Results, add_results_options

    add_results_options(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    results = Results.from_args("republish", args)
    trees = ([("baseline", args.baseline_tree.resolve())] if args.baseline_tree else []) + [("this", ROOT)]
    forwarded = [a for a in sys.argv[1:] if not a.startswith("--baseline-tree") and a != str(args.baseline_tree)]
    res = {"rows": args.rows, "every": args.every, "loadavg_at_start": [round(x, 1) for x in os.getloadavg()],
           "runs": []}
    for rnd in range(args.rounds):
        for label, tree in trees:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
            child_run = subprocess.run([sys.executable, str(ROOT / "perf" / "bench_republish.py"), *forwarded,
                                        "--child"], env=env, cwd=str(ROOT), capture_output=True, text=True)
            if child_run.returncode != 0:  # the child's own traceback, not only the parent's CalledProcessError
                sys.stderr.write(child_run.stderr[-6000:])
                raise SystemExit(f"bench_republish: the {label} child exited with {child_run.returncode}")
            run = json.loads(child_run.stdout.strip().splitlines()[-1])
            res["model"] = run.pop("model")
            res["runs"].append({"round": rnd, "tree": label, **run})
            print(json.dumps(res["runs"][-1]), flush=True)
            res["loadavg_at_end"] = [round(x, 1) for x in os.getloadavg()]
            results.write(res, report(res, results.command))  # after every run: a cut-short run keeps its rounds
    return 0


if __name__ == "__main__":
    sys.exit(main())
