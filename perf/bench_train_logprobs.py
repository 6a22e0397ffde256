"""The trainer's logprobs against the engine's, per dtype: how far the importance ratio's two sides
(the engine's sampled-token logprob, the trainer's forward on the same tokens) are apart before any
update, i.e. the numerics gap alone (issue 33).

For each dtype the engine serves the model in-process and samples `--seqs` completions (temperature
1, the sampled token's logprob); the trainer's policy (parallm.training.policy.load_policy, the same
dtype, fresh LoRA: B = 0, so it equals the base) scores the same tokens with grpo.token_logprobs.
Reports mean / p99 / max |gap| and the mean importance ratio exp(trainer - engine).

    PYTHONPATH=$PWD python -m perf.bench_train_logprobs                 # default model -> train-logprobs-cpu.*
    PYTHONPATH=$PWD python -m perf.bench_train_logprobs --model DIR --dtypes bfloat16,quantized   # GPU
"""

from __future__ import annotations

import argparse
import math
import uuid

import mlx.core as mx

from perf.harness import Results, add_results_options


def engine_samples(model: str, dtype: str, seqs: int, tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    from parallm.config import Config, ModelConfig, ServerConfig
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.models import load_model
    from parallm.protocol import SamplingParams

    config = Config(model=ModelConfig(path=model, dtype=dtype), server=ServerConfig(max_logprobs=-1))
    engine = Engine(EngineModel.of(load_model(config.model)), config)
    prompt = [1, 504, 3458, 282, 314, 2362, 30, 216]
    got: dict[str, tuple[list[int], list[float]]] = {}
    for i in range(seqs):
        rid = uuid.uuid4().hex
        got[rid] = ([], [])
        params = SamplingParams(max_tokens=tokens, temperature=1.0, logprobs=True, seed=i, ignore_eos=True)
        engine.add_request(make_request(rid, prompt, params))
    while engine.has_work():
        for out in engine.step():
            ids, lps = got[out.rid]
            ids += out.token_ids
            lps += out.logprobs or []
    del engine
    return [(prompt, ids, lps) for ids, lps in got.values()]


def gap(model: str, dtype: str, seqs: int, tokens: int) -> dict:
    from parallm.config import LoRATrainConfig, ModelConfig
    from parallm.training.grpo import Sample, make_batch, token_logprobs
    from parallm.training.policy import load_policy

    rows = engine_samples(model, dtype, seqs, tokens)
    policy = load_policy(ModelConfig(path=model, dtype=dtype), LoRATrainConfig(rank=8, num_layers=8))
    batch = make_batch([Sample(prompt_ids=p, completion_ids=c, sampler_logprobs=lp) for p, c, lp in rows])
    new = token_logprobs(policy.model, batch.inputs, batch.targets)
    mask = batch.mask.astype(mx.bool_)
    diffs = sorted(abs(a - b) for a, b, m in zip(new.flatten().tolist(), batch.old_logprobs.flatten().tolist(),
                                                  mask.flatten().tolist()) if m)
    ratios = [math.exp(d) for d in (mx.where(mask, new - batch.old_logprobs, 0.0).flatten().tolist())]
    n = len(diffs)
    return {"dtype": dtype, "trainer_dtype": policy.dtype, "tokens": n, "gap_mean": sum(diffs) / n,
            "gap_p99": diffs[min(n - 1, int(0.99 * n))], "gap_max": diffs[-1],
            "ratio_mean": sum(r for r, m in zip(ratios, mask.flatten().tolist()) if m) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16,quantized")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    add_results_options(ap, "logprobs")
    args = ap.parse_args()
    from parallm import blas

    blas.reexec_with_openblas()
    rows = [gap(args.model, d, args.seqs, args.tokens) for d in args.dtypes.split(",")]
    lines = [f"# Trainer vs engine logprobs of the same sampled tokens ({args.model})", "",
             f"{args.seqs} completions x {args.tokens} tokens per dtype, temperature 1, before any update "
             "(fresh LoRA, B = 0).", "",
             "| dtype | tokens | mean \\|gap\\| | p99 \\|gap\\| | max \\|gap\\| | mean ratio |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['dtype']} | {r['tokens']} | {r['gap_mean']:.2e} | {r['gap_p99']:.2e} | {r['gap_max']:.2e} | "
              f"{r['ratio_mean']:.4f} |" for r in rows]
    results = Results.from_args("train", args)
    results.write({"model": args.model, "rows": rows}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
