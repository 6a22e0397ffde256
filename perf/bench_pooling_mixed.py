"""Generation and pooling at once (issue 31): 16 closed-loop chat streams alone, then the same 16 while
an embeddings burst runs (B clients each posting 32 texts to /v1/embeddings in a loop), on one server
serving the default LM and all-MiniLM-L6-v2 beside it. Reports generation tokens/s in both phases (the
drop), embeddings/s during the burst, and every error (there must be none).

    PYTHONPATH=$PWD python -m perf.bench_pooling_mixed            # -> perf/results/pooling-mixed-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx

from perf.harness import Results, Server, add_results_options

TEXTS = json.loads((Path(__file__).resolve().parent.parent / "tests" / "data" / "minilm_texts.json").read_text())


async def chat_stream(http: httpx.AsyncClient, stop: float, max_tokens: int, tally: Counter) -> None:
    while time.monotonic() < stop:
        body = {"messages": [{"role": "user", "content": "Tell me a long story about a garden."}],
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                tally[f"chat_{r.status_code}"] += 1
                continue
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"]
                    if delta and delta[0].get("delta", {}).get("content"):
                        tally["tokens"] += 1
        tally["chats"] += 1


async def embed_burst(http: httpx.AsyncClient, stop: float, tally: Counter) -> None:
    while time.monotonic() < stop:
        r = await http.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "base64"})
        if r.status_code != 200:
            tally[f"embed_{r.status_code}"] += 1
            continue
        tally["embeddings"] += len(r.json()["data"])


async def phase(url: str, seconds: float, streams: int, burst: int, max_tokens: int) -> dict:
    tally: Counter = Counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        t0 = time.monotonic()
        stop = t0 + seconds
        await asyncio.gather(*[chat_stream(http, stop, max_tokens, tally) for _ in range(streams)],
                             *[embed_burst(http, stop, tally) for _ in range(burst)])
        wall = time.monotonic() - t0
    return {"wall_s": round(wall, 1), "generation_tokens_per_s": round(tally["tokens"] / wall, 1),
            "embeddings_per_s": round(tally["embeddings"] / wall, 1), "chats": tally["chats"],
            "errors": {k: v for k, v in tally.items() if k.startswith(("chat_", "embed_"))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--burst", type=int, default=4, help="embedding clients during the burst phase")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pooling-batch-tokens", type=int, help="engine.pooling_batch_tokens of the started server")
    parser.add_argument("--url", help="an already running server (with --pooling-model minilm=default)")
    add_results_options(parser)
    args = parser.parse_args()
    extra = ["--engine.pooling-batch-tokens", str(args.pooling_batch_tokens)] if args.pooling_batch_tokens else []
    server = None if args.url else Server("--pooling-model", "minilm=default", *extra)
    try:
        if server is not None:
            server.__enter__()
        url = args.url or server.url
        asyncio.run(phase(url, 5, args.streams, 1, 8))  # warm-up
        alone = asyncio.run(phase(url, args.seconds, args.streams, 0, args.max_tokens))
        mixed = asyncio.run(phase(url, args.seconds, args.streams, args.burst, args.max_tokens))
        after = asyncio.run(phase(url, args.seconds, args.streams, 0, args.max_tokens))
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    base = (alone["generation_tokens_per_s"] + after["generation_tokens_per_s"]) / 2
    drop = 1 - mixed["generation_tokens_per_s"] / base if base else 0.0
    result = {"pooling_batch_tokens": args.pooling_batch_tokens, "streams": args.streams, "burst_clients": args.burst, "seconds": args.seconds,
              "max_tokens": args.max_tokens, "alone": alone, "with_embeddings_burst": mixed, "alone_after": after,
              "generation_drop": round(drop, 3), "loadavg": os.getloadavg()}
    md = "\n".join([
        "# Generation with an embeddings burst", "",
        f"{args.streams} closed-loop chat streams ({args.max_tokens} tokens each, ignore_eos), {args.seconds:g} s per "
        f"phase; burst: {args.burst} clients posting 32 texts each to /v1/embeddings in a loop.", "",
        "| phase | generation tok/s | embeddings/s | errors |", "|---|---|---|---|",
        *(f"| {name} | {p['generation_tokens_per_s']} | {p['embeddings_per_s']} | {sum(p['errors'].values())} |"
          for name, p in (("alone", alone), ("with burst", mixed), ("alone after", after))),
        "", f"Generation throughput drop during the burst: {100 * drop:.0f}% (against the mean of the two alone "
        "phases)."])
    results = Results.from_args("pooling-mixed", args)
    print(results.write(result, md))
    print(md)


if __name__ == "__main__":
    main()
