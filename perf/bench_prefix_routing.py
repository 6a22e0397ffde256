"""Prefix-aware routing across data-parallel replicas (issue 38): the prefix-cache hit rate of a
multi-turn chat workload served by one engine and by `--engine.replicas 2`, on the same model.

Each of `--sessions` conversations opens with a system prompt every session shares and a document
of its own (`--doc-words` random words), then runs `--turns` turns: the whole conversation so far
plus a new question, answered greedily (`--max-tokens`), the answer appended. `--concurrency`
sessions run at once, so turns of different sessions interleave as they would from many users.
A turn's prompt repeats its session's previous prompt and answer, so the engine that served that turn
holds those blocks: routing must send the next turn there (parallm/routing.py) for it to hit.

The hit rate is the engines' own count over the run: prefix_hit_tokens / prefix_queried_tokens,
summed over the replicas (replica 0's stats carry the others'). Goal: with 2 replicas >= 0.9x one
engine's. Also reported: each replica's share of the prompt tokens (routing that sent everything to
one replica would hit as well as one engine, and use one engine).

    python -m perf.bench_prefix_routing                    # default model, 1 then 2 replicas
    python -m perf.bench_prefix_routing --sessions 32 --turns 6 --concurrency 16

Results: perf/results/prefix-routing-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

from perf.harness import Results, Server, add_results_options

WORDS = ("river stone lantern harbor meadow copper signal orchard canyon ember glacier timber "
         "compass willow beacon quarry falcon thistle prairie anchor").split()
SYSTEM = ("You are a careful assistant for a document archive. Answer each question about the document "
          "the user gave in one short sentence, quoting the document where you can.")


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def session(client: openai.OpenAI, model: str, index: int, args: argparse.Namespace) -> int:
    """One conversation of args.turns turns; returns its requests."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Document {index}: {document(index, args.doc_words)}\n\nWhat is it about?"}]
    for turn in range(args.turns):
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                temperature=0.0)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                     {"role": "user", "content": f"Question {turn + 2}: which word comes {turn + 2}th?"}]
    return args.turns


def prefix_counts(server: Server) -> list[dict[str, int]]:
    """Each replica's prompt tokens looked up in its prefix cache, found there, and computed, so far;
    replica 0 first."""
    stats = server.engine_stats()
    return [{"queried": s.prefix_queried_tokens, "hit": s.prefix_hit_tokens, "prompt": s.prompt_tokens_computed}
            for s in [stats, *stats.replicas]]


def run(replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--engine.replicas", str(replicas), *args.server_args]
    with Server(*flags) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        before = prefix_counts(server)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            requests = sum(pool.map(lambda i: session(client, model, i, args), range(args.sessions)))
        wall = time.perf_counter() - start
        time.sleep(1.5)  # the other replicas' stats reach replica 0 about every second
        after = prefix_counts(server)
    per_replica = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before + [{}] * len(after))]
    queried = sum(r["queried"] for r in per_replica)
    hit = sum(r["hit"] for r in per_replica)
    return {"replicas": replicas, "requests": requests, "wall_s": round(wall, 1), "queried_tokens": queried,
            "hit_tokens": hit, "hit_rate": round(hit / queried, 4) if queried else 0.0,
            "computed_prompt_tokens": sum(r["prompt"] for r in per_replica), "per_replica": per_replica}


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# Prefix-cache hit rate, one engine vs {data['runs'][-1]['replicas']} replicas", "",
             f"Command: `{data['command']}`", "",
             f"{data['args']['sessions']} sessions x {data['args']['turns']} turns, {data['args']['concurrency']} at "
             f"once, {data['args']['doc_words']}-word documents, {data['args']['max_tokens']} tokens per answer.", "",
             "| replicas | hit rate | hit / queried tokens | prompt tokens computed | queried tokens per replica | wall s |",
             "|---|---|---|---|---|---|"]
    for r in data["runs"]:
        share = " / ".join(str(x["queried"]) for x in r["per_replica"])
        lines.append(f"| {r['replicas']} | {r['hit_rate']:.3f} | {r['hit_tokens']:,} / {r['queried_tokens']:,} | "
                     f"{r['computed_prompt_tokens']:,} | {share} | {r['wall_s']} |")
    lines += ["", f"Ratio (replicas / one engine): **{data['ratio']:.3f}** (goal >= 0.9)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--doc-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--replicas", type=int, default=2, help="the layout compared with one engine")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="more parallm-launch flags for both servers (last on the line)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("prefix-routing", args, argv)
    runs = [run(1, args), run(args.replicas, args)]
    data = {"args": {k: v for k, v in vars(args).items() if k not in ("out_dir", "out")}, "runs": runs,
            "ratio": round(runs[1]["hit_rate"] / runs[0]["hit_rate"], 4) if runs[0]["hit_rate"] else 0.0}
    text = markdown({"command": results.command, **data})
    results.write(data, text)
    print(text)


if __name__ == "__main__":
    main()
