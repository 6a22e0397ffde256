"""Teacher scoring and full-weight updates as RL trainers drive them (issue 21), in process.

1. TRL 1.16's get_sequence_logprobs: B sequences of L tokens, `max_tokens` 1, `prompt_logprobs` k for
   k in 0, 20, 100 (each prompt token's logprob and vLLM rank, plus k alternatives): ms per batch and
   scored tokens/s, the cost of the rank and of 100 alternatives over k=0.
2. A full-weight update of every tensor of the model: from a directory (/update_weights), and sent as
   one chunk per layer over PUB (weights.ChunkStaging: each chunk checked and written to the staging
   directory, then applied from it): ms for each, and the staging's share.

    PYTHONPATH=$PWD python -m perf.bench_rl_logprobs                      # -> perf/results/rl-logprobs-cpu.*
    PYTHONPATH=$PWD python -m perf.bench_rl_logprobs --model Qwen/Qwen3-0.6B --seqs 32 --length 1024   # GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from perf.harness import Results, add_results_options


def scoring(engine, vocab: int, seqs: int, length: int, ks: list[int], iters: int) -> dict:
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    mx.random.seed(0)
    batch = mx.random.randint(1, vocab, (seqs, length)).tolist()
    out = {}
    for k in ks:
        times = []
        for i in range(iters + 1):
            params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k)
            t0 = time.perf_counter()
            for seq in batch:
                engine.add_request(make_request(uuid.uuid4().hex, seq, params))
            while engine.has_work():
                engine.step()
            if i:   # the first run of each k compiles and warms up
                times.append(1000 * (time.perf_counter() - t0))
        ms = statistics.median(times)
        out[f"k={k}"] = {"ms_per_batch": round(ms, 1), "scored_tokens_per_s": round(seqs * (length - 1) / ms * 1000)}
    return out


def weight_update(engine, root: Path) -> dict:
    from parallm.adapters import save_bytes
    from parallm.engine.weights import ChunkStaging, by_layer

    weights = {k: v * 1.001 for k, v in tree_flatten(engine.model.parameters())}
    mx.eval(weights)
    directory = root / "dir"
    directory.mkdir()
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    t0 = time.perf_counter()
    engine.update_weights(path=str(directory))
    from_dir = 1000 * (time.perf_counter() - t0)
    chunks = [save_bytes(group) for group in by_layer(weights)]
    staging = ChunkStaging(engine.weights.check_chunk, root=str(root))
    t0 = time.perf_counter()
    for i, blob in enumerate(chunks):
        staged = staging.add("bench", i, len(chunks), blob)
    staged_ms = 1000 * (time.perf_counter() - t0)
    engine.update_weights(path=str(staged.directory))
    total = 1000 * (time.perf_counter() - t0)
    staging.done(version=engine.weights_version)
    staging.close()
    size = sum(len(b) for b in chunks)
    return {"bytes": size, "chunks": len(chunks), "from_directory_ms": round(from_dir, 1),
            "chunked_ms": round(total, 1), "of_which_staging_ms": round(staged_ms, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--ks", default="0,20,100")
    ap.add_argument("--iters", type=int, default=3)
    add_results_options(ap, "logprobs")
    args = ap.parse_args()
    from parallm import blas

    blas.reexec_with_openblas()
    from parallm.config import Config, ModelConfig, ServerConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model

    config = Config(model=ModelConfig(path=args.model), server=ServerConfig(max_logprobs=-1))
    loaded = load_model(config.model)
    engine = Engine(EngineModel.of(loaded), config)
    result = {"model": args.model, "seqs": args.seqs, "length": args.length, "loadavg_start": os.getloadavg()}
    result["scoring"] = scoring(engine, loaded.vocab_size, args.seqs, args.length,
                                [int(k) for k in args.ks.split(",")], args.iters)
    with tempfile.TemporaryDirectory() as root:
        result["weight_update"] = weight_update(engine, Path(root))
    result["loadavg_end"] = os.getloadavg()
    lines = [f"# RL teacher scoring and full-weight updates ({args.model})", "",
             f"get_sequence_logprobs: {args.seqs} sequences x {args.length} tokens, max_tokens 1", "",
             "| prompt_logprobs k | ms per batch | scored tokens/s |", "|---|---|---|"]
    lines += [f"| {k[2:]} | {v['ms_per_batch']} | {v['scored_tokens_per_s']} |" for k, v in result["scoring"].items()]
    w = result["weight_update"]
    lines += ["", f"full-weight update of {w['bytes'] / 2**20:.0f} MiB in {w['chunks']} chunks: from a directory "
              f"{w['from_directory_ms']} ms; chunked {w['chunked_ms']} ms (staging {w['of_which_staging_ms']} ms)"]
    results = Results.from_args("rl", args)
    results.write(result, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
