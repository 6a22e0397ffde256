"""Can the engine and a trainer share the base weights' memory (issue 33 item 2)? Two processes load the
same model the way the engine and the trainer do, and their memory maps say whether the weights are
private copies (anonymous memory, counted once per process) or pages of one file both map (file-backed,
shared: Pss counts them half in each).

    PYTHONPATH=$PWD python -m perf.bench_weight_sharing                  # the default model (float32 on the CPU)
    PYTHONPATH=$PWD python -m perf.bench_weight_sharing --model DIR      # an MLX model directory

Ways: `load_model` (parallm's loader, what the engine and the trainer call) and `mx.load` (MLX's own
safetensors reader on the model's .safetensors files, arrays evaluated). Linux only (/proc smaps_rollup).
Writes perf/results/weight-sharing-DEVICE.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from perf.harness import Results, add_results_options, describe

FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty", "Anonymous")


def smaps(pid: int | str = "self") -> dict[str, int]:
    """Memory of a process in MiB, from /proc/PID/smaps_rollup."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            out[key] = int(rest.split()[0]) // 1024
    return out


def child(way: str, model: str) -> None:
    """Load, report the weights' bytes, then wait (so the parent reads both processes' maps at once)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if way == "load_model":
        from parallm.config import ModelConfig
        from parallm.models.loader import load_model

        loaded = load_model(ModelConfig(path=model))
        arrays = [v for _, v in tree_flatten(loaded.model.parameters())]
        where = str(loaded.source.path)
    else:
        files = sorted(Path(model).glob("*.safetensors"))
        arrays = [a for f in files for a in mx.load(str(f)).values()]
        where = ", ".join(f.name for f in files)
    mx.eval(arrays)
    print(json.dumps({"weights_mib": sum(a.nbytes for a in arrays) // 2 ** 20, "from": where}), flush=True)
    sys.stdin.readline()


def materialized_dir(model: str) -> str:
    """The directory of safetensors the loader reads for `model` (the default model's conversion)."""
    from parallm.config import ModelConfig
    from parallm.models.resolve import resolve_model

    source = resolve_model(ModelConfig(path=model))
    return str(getattr(source, "path", source))


def measure(way: str, model: str) -> dict:
    procs = [subprocess.Popen([sys.executable, "-m", "perf.bench_weight_sharing", "--child", way, "--model", model],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        before = [smaps(p.pid) for p in procs]
        info = [json.loads(p.stdout.readline()) for p in procs]
        time.sleep(0.5)
        after = [smaps(p.pid) for p in procs]
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=60)
    weights = info[0]["weights_mib"]
    return {"way": way, "weights_mib": weights, "from": info[0]["from"], "processes": after,
            "sum_rss_mib": sum(a["Rss"] for a in after), "sum_pss_mib": sum(a["Pss"] for a in after),
            "anonymous_mib": [a["Anonymous"] for a in after], "early": before,
            "shared_mib": [a["Shared_Clean"] + a["Shared_Dirty"] for a in after]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--child", choices=["load_model", "mx.load"])
    add_results_options(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model)
        return
    rows = [measure("load_model", args.model)]
    directory = args.model if Path(args.model).is_dir() else materialized_dir(args.model)
    if any(Path(directory).glob("*.safetensors")):
        rows.append(measure("mx.load", directory))
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("processes", "early")}))
    results = Results.from_args("weight-sharing", args)
    lines = ["# Sharing the base weights between two processes\n", f"Command: `{results.command}`  ",
             f"Machine: {describe(results.machine)}. Model: {args.model}.\n",
             "Two processes each load the model and wait; their /proc smaps_rollup read at once. Weights "
             "shared through one file's pages would be file-backed and shared (Pss about half of Rss); private "
             "copies are anonymous memory, once per process.\n",
             "| way | weights MiB | Rss MiB (both) | Pss MiB (both) | anonymous MiB (each) | shared MiB (each) |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['weights_mib']} | {r['sum_rss_mib']} | {r['sum_pss_mib']} | "
                     f"{' / '.join(map(str, r['anonymous_mib']))} | {' / '.join(map(str, r['shared_mib']))} |")
    results.write({"model": args.model, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
