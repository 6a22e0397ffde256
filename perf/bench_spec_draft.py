"""Speculative decoding, draft mode (issue 36), on model shapes (parallm.models.shapes: random weights, built
once under --work-dir with --tokenizer-dir's tokenizer): a target shape and a small draft shape, in process,
greedy, random prompts.

- single stream: off; the small draft as it is (random weights; note that random models with tied
  embeddings and small weights both mostly repeat their input token, so this pair's acceptance is
  what it is, often high, and says nothing about real drafts); the oracle below at alpha 0 with the
  default controller (acceptance 0: the controller rests the row; what draft mode costs when it does
  not pay); the small draft with its proposals replaced by an
  oracle that is right with probability alpha per token (the target's own greedy continuation, known
  from the off run, else a wrong token), for each alpha of --alphas, the controller off (min_acceptance
  0): decode tok/s against acceptance at the small draft's cost, i.e. the overhead vs acceptance curve
  (the draft's passes still run: the oracle only replaces their tokens, whose graph is evaluated, so
  its cost is paid; the draft's own KV then holds its own tokens, which only matters to its quality);
  and the target as its own draft ("self": acceptance 1 with a draft as costly as the target: the
  draft-mode ceiling when proposing costs a target step, i.e. what the verify pass and the k - 1 extra
  target-sized steps cost; the oracle at alpha 1 against it isolates the small draft's saving);
- batches (--batches, default 16 and 64): off; draft mode with the defaults (spec.disable_batch_size 4:
  no speculation at these sizes, the goal is not below 0.95x of off); draft mode forced on
  (disable_batch_size = the batch) with the random draft and with the oracle at alpha 0.8.
- with --mlx-lm: mlx-lm's own speculative decoding (mlx_lm.generate.speculative_generate_step, what
  mlx_lm.server --draft-model runs, one stream) on the same target and draft, against mlx-lm without a
  draft (generate_step), and the self pair: a fair single-stream pair on the same weights.

Decode tok/s is (tokens - first) / (time of the last - time of the first token), median over --rounds.

    python -m perf.bench_spec_draft --shape llama-3.2-3b --draft-shape llama-draft-small --tokenizer-dir DIR  # GPU
    python -m perf.bench_spec_draft --shape smollm2-135m --draft-shape tiny-draft --tokenizer-dir DIR \\
        --dtype float32 --max-tokens 32 --batches 4 --mlx-lm --out-dir /tmp/sd   # a CPU smoke run

Results: perf/results/spec-draft-<shape>-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from perf.harness import Results, add_results_options


def log(msg: str) -> None:
    print(f"[bench_spec_draft {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load(shape: str, args) -> Any:
    from parallm.config import ModelConfig
    from parallm.models import load_model
    from parallm.models.shapes import build_model_dir

    path = build_model_dir(shape, args.work_dir / shape, args.tokenizer_dir)
    return path, load_model(ModelConfig(path=str(path), dtype=args.dtype))


def make_engine(lm, draft=None, *, kv_mb: int, **spec) -> Any:
    from parallm.config import Config, EngineConfig, SpecConfig
    from parallm.engine import Engine, EngineModel

    config = Config(engine=EngineConfig(kv_budget_mb=kv_mb), spec=SpecConfig(**spec))
    engine = Engine(EngineModel(lm.model, (), min(lm.max_model_len, 4096), lm.vocab_size, draft=draft), config)
    engine.warm_up()
    return engine


class Oracle:
    """Replaces the draft's proposals by the target's greedy continuation (ref[i] of request i), each token
    right with probability alpha (a fixed hash of the request and position), else that token + 1."""

    def __init__(self, engine, refs: list[list[int]], alpha: float, vocab: int) -> None:
        self.refs, self.alpha, self.vocab = refs, alpha, vocab
        draft = engine.spec.draft
        real = draft.propose

        def propose(seqs, ks, keep=()):
            import mlx.core as mx

            prop = real(seqs, ks, keep)
            rows = [[self.token(s.rid, s.num_output + j) for j in range(prop.kmax)] for s in seqs]
            prop.tokens = mx.array(rows, dtype=mx.int32) + prop.tokens * 0  # the draft's graph still runs
            return prop

        draft.propose = propose

    def token(self, rid: str, position: int) -> int:
        from parallm.engine.sampling import splitmix64

        i = int(rid.rsplit("-", 1)[1])
        ref = self.refs[i]
        right = ref[position] if position < len(ref) else 0
        u = (splitmix64(i * 1_000_003 + position) % 10_000) / 10_000
        return right if u < self.alpha else (right + 1) % self.vocab


def run(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats().spec
    for i, ids in enumerate(prompts):
        engine.add_request(make_request(f"{tag}-{i}", ids, params=params))
    tokens: dict[int, list[int]] = {}
    first = last = 0.0
    while engine.has_work():
        for o in engine.step():
            if o.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens.setdefault(int(o.rid.rsplit("-", 1)[1]), []).extend(o.token_ids)
    total = sum(len(t) for t in tokens.values())
    out: dict[str, Any] = {"decode_tok_s": (total - len(prompts)) / (last - first),
                           "ids": [tokens[i] for i in range(len(prompts))]}
    after = engine.stats().spec
    if after is not None:
        proposed = after.proposed_tokens - before.proposed_tokens
        out["acceptance"] = (after.accepted_tokens - before.accepted_tokens) / proposed if proposed else 0.0
        out["verify_passes"] = after.verify_passes - before.verify_passes
    return out


def measure(engine, prompts, max_tokens: int, rounds: int, name: str) -> dict[str, Any]:
    runs = [run(engine, prompts, max_tokens, f"{name}{r}") for r in range(rounds)]
    out = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs), "ids": runs[0]["ids"],
           "runs": [r["decode_tok_s"] for r in runs]}
    if "acceptance" in runs[0]:
        out["acceptance"] = statistics.median(r["acceptance"] for r in runs)
        out["verify_passes"] = runs[0]["verify_passes"]
    return out


def mlx_lm_pair(target, draft, prompt: list[int], max_tokens: int, k: int, rounds: int) -> dict[str, Any]:
    """mlx-lm single stream: generate_step, then speculative_generate_step with `draft` (and with the
    target as its own draft), greedy: decode tok/s and the fraction of tokens that came from the draft."""
    import importlib

    import mlx.core as mx

    g = importlib.import_module("mlx_lm.generate")

    def rate(make) -> tuple[float, float, list[int]]:
        toks, from_draft, first = [], 0, 0.0
        for tok, _, *rest in make():
            now = time.perf_counter()
            first = first or now
            toks.append(int(tok))
            from_draft += bool(rest and rest[0])
        return (len(toks) - 1) / (now - first), from_draft / len(toks), toks

    out: dict[str, Any] = {}
    for name, make in (("off", lambda: g.generate_step(mx.array(prompt), target.model, max_tokens=max_tokens)),
                       ("draft", lambda: g.speculative_generate_step(mx.array(prompt), target.model, draft.model,
                                                                     num_draft_tokens=k, max_tokens=max_tokens)),
                       ("self", lambda: g.speculative_generate_step(mx.array(prompt), target.model, target.model,
                                                                    num_draft_tokens=k, max_tokens=max_tokens))):
        got = [rate(make) for _ in range(rounds)]
        out[name] = {"decode_tok_s": statistics.median(r[0] for r in got), "from_draft": got[0][1], "ids": got[0][2]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-3b", help="the target's shape (parallm.models.shapes)")
    ap.add_argument("--draft-shape", default="llama-draft-small", help="the draft's shape")
    ap.add_argument("--tokenizer-dir", type=Path, required=True, help="a directory with tokenizer.json (both models')")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-bench-spec-draft"))
    ap.add_argument("--dtype", default=None, help="model.dtype of both (unset: the backend's default)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="spec.k")
    ap.add_argument("--alphas", default="0,0.5,0.7,0.8,0.9,1", help="the oracle's per-token right rates")
    ap.add_argument("--ways", default=None,
                    help="only these single-stream ways, comma-separated (draft, oracle-0-controller, self, "
                         "oracle-<alpha> of --alphas); unset: all")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-mb", type=int, default=4096, help="engine.kv_budget_mb of each engine")
    ap.add_argument("--mlx-lm", action="store_true", help="also mlx-lm's speculative decoding, one stream")
    add_results_options(ap, default_help="<shape>")
    ap.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS of the preloaded OpenBLAS (CPU)")
    args = ap.parse_args(argv)
    if args.ways is not None:
        names = {"draft", "oracle-0-controller", "self"} | {f"oracle-{float(a):g}" for a in args.alphas.split(",")}
        if unknown := set(args.ways.split(",")) - names:
            ap.error(f"--ways: no way named {', '.join(sorted(unknown))} (with --alphas {args.alphas})")
    from parallm import blas

    if not blas.is_preloaded():
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    blas.reexec_with_openblas()
    files = Results.from_args("spec", args, argv, experiment=args.experiment or f"draft-{args.shape}")
    (_, target), (_, draft) = load(args.shape, args), load(args.draft_shape, args)
    vocab = target.vocab_size
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",") if b]
    prompts = [rng.integers(3, min(vocab, 32000), size=args.prompt_len).tolist() for _ in range(max(batches + [1]))]
    kv = args.kv_mb
    results: dict[str, Any] = {"shape": args.shape, "draft_shape": args.draft_shape, "dtype": target.dtype,
                               "k": args.k, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                               "single": {}, "batches": {}}

    def write() -> None:
        files.write(results, markdown(results, files.command))

    off = make_engine(target, kv_mb=kv)
    one = [prompts[0]]
    base = measure(off, one, args.max_tokens, args.rounds, "off")
    results["single"]["off"] = {"decode_tok_s": base["decode_tok_s"]}
    log(f"single off: {base['decode_tok_s']:.1f} tok/s")
    ways: list[tuple[str, Any, dict, float | None]] = [
        ("draft", draft.model, {}, None), ("oracle-0-controller", draft.model, {}, 0.0),
        ("self", target.model, {"min_acceptance": 0.0}, None)]
    ways += [(f"oracle-{a:g}", draft.model, {"min_acceptance": 0.0}, a) for a in map(float, args.alphas.split(","))]
    if args.ways is not None:
        ways = [w for w in ways if w[0] in args.ways.split(",")]
    for name, model, extra, alpha in ways:
        engine = make_engine(target, model, kv_mb=kv, mode="draft", k=args.k, **extra)
        if alpha is not None:
            Oracle(engine, base["ids"], alpha, vocab)
        got = measure(engine, one, args.max_tokens, args.rounds, name)
        results["single"][name] = {"decode_tok_s": got["decode_tok_s"], "speedup": got["decode_tok_s"] / base["decode_tok_s"],
                                   "acceptance": got["acceptance"], "verify_passes": got["verify_passes"],
                                   "same_tokens": got["ids"] == base["ids"], "alpha": alpha}
        log(f"single {name}: {got['decode_tok_s']:.1f} tok/s ({got['decode_tok_s'] / base['decode_tok_s']:.2f}x), "
            f"acceptance {got['acceptance']:.2f}, same tokens {got['ids'] == base['ids']}")
        del engine
        write()
    for b in batches:
        batch = prompts[:b]
        ref = measure(off, batch, args.batch_tokens, args.rounds, f"off{b}-")
        entry: dict[str, Any] = {"off": {"decode_tok_s": ref["decode_tok_s"]}}
        for name, extra, alpha, model in (("draft-defaults", {}, None, draft.model),
                                          ("draft-forced", {"disable_batch_size": b}, None, draft.model),
                                          ("oracle-0.8-forced", {"disable_batch_size": b, "min_acceptance": 0.0}, 0.8,
                                           draft.model)):
            engine = make_engine(target, model, kv_mb=kv, mode="draft", k=args.k, **extra)
            if alpha is not None:
                Oracle(engine, ref["ids"], alpha, vocab)
            got = measure(engine, batch, args.batch_tokens, args.rounds, f"{name}{b}-")
            entry[name] = {"decode_tok_s": got["decode_tok_s"], "ratio": got["decode_tok_s"] / ref["decode_tok_s"],
                           "acceptance": got["acceptance"], "verify_passes": got["verify_passes"],
                           "same_tokens": got["ids"] == ref["ids"]}
            log(f"batch {b} {name}: {got['decode_tok_s']:.1f} vs off {ref['decode_tok_s']:.1f} tok/s "
                f"({entry[name]['ratio']:.2f}x), acceptance {got['acceptance']:.2f}")
            del engine
        results["batches"][str(b)] = entry
        write()
    if args.mlx_lm:
        pair = mlx_lm_pair(target, draft, prompts[0], args.max_tokens, args.k, args.rounds)
        results["mlx_lm"] = {name: {kk: v for kk, v in e.items() if kk != "ids"} | {"same_tokens": e["ids"] == pair["off"]["ids"]}
                             for name, e in pair.items()}
        log(f"mlx-lm: {results['mlx_lm']}")
    results["loadavg"] = os.getloadavg()
    write()
    return 0


def markdown(results: dict[str, Any], command: str) -> str:
    lines = [f"# Speculative decoding, draft mode: {results['shape']} with a {results['draft_shape']} draft, "
             f"{results['dtype']}, greedy, k {results['k']}", "", f"`{command}`", "",
             f"Single stream ({results['prompt_len']}-token prompt, {results['max_tokens']} tokens):", "",
             "| way | tok/s | vs off | acceptance | verify passes | same tokens |", "|---|---|---|---|---|---|"]
    off = results["single"].get("off", {}).get("decode_tok_s", 0.0)
    for name, e in results["single"].items():
        if name == "off":
            lines.append(f"| off | {off:.1f} | 1.00x | | | |")
            continue
        lines.append(f"| {name} | {e['decode_tok_s']:.1f} | {e['speedup']:.2f}x | {e['acceptance']:.2f} | "
                     f"{e['verify_passes']} | {e['same_tokens']} |")
    for b, entry in results["batches"].items():
        lines += ["", f"Batch {b}:", "", "| way | tok/s | vs off | acceptance | verify passes | same tokens |",
                  "|---|---|---|---|---|---|", f"| off | {entry['off']['decode_tok_s']:.1f} | 1.00x | | | |"]
        for name, e in entry.items():
            if name != "off":
                lines.append(f"| {name} | {e['decode_tok_s']:.1f} | {e['ratio']:.2f}x | {e['acceptance']:.2f} | "
                             f"{e['verify_passes']} | {e['same_tokens']} |")
    if "mlx_lm" in results:
        lines += ["", "mlx-lm, one stream (speculative_generate_step, as mlx_lm.server --draft-model):", "",
                  "| way | tok/s | tokens from the draft | same tokens as its off |", "|---|---|---|---|"]
        for name, e in results["mlx_lm"].items():
            lines.append(f"| {name} | {e['decode_tok_s']:.1f} | {e['from_draft']:.2f} | {e['same_tokens']} |")
    lines += ["", "oracle-a: the small draft runs, its tokens replaced by the target's greedy continuation, each right "
              "with probability a, controller off (the acceptance curve at the small draft's cost); "
              "oracle-0-controller: acceptance 0 with the default controller (spec.min_acceptance 0.3: rows rest); "
              "draft: the random small draft as it is; self: the target as its own draft "
              f"(acceptance 1 at a target-sized draft's cost). Load average at the end: {results.get('loadavg', 'n/a')}."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
