"""The KV disk tier across a whole-server restart (issue 41): TTFT of a prompt whose ~1,000-token
prefix was served before the restart (its blocks read back from --kv.disk-dir) against a cold one.

1. parallm-launch with --kv.disk-dir DIR serves `--trials` prompts, each a fresh random prefix of
   `--prefix-tokens` token ids plus a short suffix (one token each), and is stopped (SIGTERM: the
   engine writes its cached blocks on the way out with evict_only; write_through wrote them already).
2. A new parallm-launch on the same DIR serves, per trial, a cold prompt (a prefix never seen) and a
   warm one (the trial's prefix with another suffix), in alternating order; both stream, TTFT is the
   time to the first token's event.
3. The engine's stats after the run: disk hits/misses/corrupt files, prefix hit tokens, and
   check_integrity's count of failures (the stage runs it each time it goes idle).

    python -m perf.bench_kv_disk                                  # CPU, default model, 1,000-token prefixes
    python -m perf.bench_kv_disk --policy write_through --trials 5 -- --engine.max-num-seqs 8

Results: perf/results/kv-disk-restart-<device>.json and .md. Goal: warm TTFT <= 0.25x cold.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

import httpx

from parallm.protocol import EngineStats
from perf.harness import Results, Server, add_results_options

SUFFIX_TOKENS = 8


def random_ids(n: int, seed: int, low: int = 1000, high: int = 30000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


def ttft(url: str, prompt: list[int], max_tokens: int = 2, timeout: float = 300.0) -> float:
    """Seconds from sending a streamed /v1/completions of token ids to its first token's event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and '"text"' in line:
                first = time.perf_counter() - start
                for _ in lines:  # read the rest: the request ends cleanly
                    pass
                return first
    raise RuntimeError("the stream ended without a token")


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> list[int]:
    """Greedy token ids of a /v1/completions (vLLM's return_token_ids)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def engine_kv(stats: EngineStats) -> dict[str, Any]:
    """The engine's disk-tier stats and integrity counters."""
    disk = stats.kv_disk
    return {"disk": {f: getattr(disk, f) for f in disk.__struct_fields__} if disk else None,
            "prefix_hit_tokens": stats.prefix_hit_tokens, "prompt_tokens_computed": stats.prompt_tokens_computed,
            "integrity_checks": stats.integrity_checks, "integrity_failures": stats.integrity_failures}


def wait_idle_checked(server: Server) -> dict[str, Any]:
    return engine_kv(server.engine_stats_after_idle_check())


def run(args: argparse.Namespace, server_args: list[str]) -> dict[str, Any]:
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="parallm-kv-disk-")
    flags = ["--kv.disk-dir", disk_dir, "--kv.disk-policy", args.policy, *server_args]
    prefixes = [random_ids(args.prefix_tokens, seed=1000 + i) for i in range(args.trials)]
    before_tokens = []
    with Server(*flags) as first:
        for i, prefix in enumerate(prefixes):
            before_tokens.append(complete(first.url, prefix + random_ids(SUFFIX_TOKENS, seed=i)))
        before = wait_idle_checked(first)
        first.stop()
    cold, warm, same = [], [], []
    with Server(*flags) as second:
        for i, prefix in enumerate(prefixes):
            fresh = random_ids(args.prefix_tokens, seed=5000 + i) + random_ids(SUFFIX_TOKENS, seed=9000 + i)
            shared = prefix + random_ids(SUFFIX_TOKENS, seed=7000 + i)
            order = [("cold", fresh), ("warm", shared)] if i % 2 == 0 else [("warm", shared), ("cold", fresh)]
            for kind, prompt in order:
                (cold if kind == "cold" else warm).append(ttft(second.url, prompt))
            # what the first server answered is what the blocks read back give
            same.append(complete(second.url, prefix + random_ids(SUFFIX_TOKENS, seed=i)) == before_tokens[i])
        after = wait_idle_checked(second)
    ratio = statistics.median(warm) / statistics.median(cold)
    return {"policy": args.policy, "prefix_tokens": args.prefix_tokens, "trials": args.trials,
            "server_args": server_args, "ttft_cold_s": [round(t, 4) for t in cold],
            "ttft_warm_s": [round(t, 4) for t in warm], "ttft_cold_median_s": round(statistics.median(cold), 4),
            "ttft_warm_median_s": round(statistics.median(warm), 4), "warm_over_cold": round(ratio, 4),
            "goal": "warm_over_cold <= 0.25", "met": ratio <= 0.25, "same_tokens_after_restart": same,
            "engine_before_restart": before, "engine_after_restart": after}


def markdown(record: dict[str, Any]) -> str:
    after = record["engine_after_restart"]
    disk = after["disk"] or {}
    return "\n".join([
        "# KV disk tier across a whole-server restart",
        "",
        f"`{record['command']}`",
        "",
        f"{record['trials']} trials, {record['prefix_tokens']}-token prefixes, policy {record['policy']}.",
        "",
        "| | TTFT median (s) | all (s) |",
        "|---|---|---|",
        f"| cold (prefix never seen) | {record['ttft_cold_median_s']} | {record['ttft_cold_s']} |",
        f"| warm (prefix read from disk after the restart) | {record['ttft_warm_median_s']} | "
        f"{record['ttft_warm_s']} |",
        "",
        f"warm / cold = **{record['warm_over_cold']}** (goal <= 0.25: {'met' if record['met'] else 'NOT met'}); "
        f"same tokens as before the restart: {record['same_tokens_after_restart']}.",
        "",
        f"After the restart: disk hits {disk.get('hits')}, misses {disk.get('misses')}, read "
        f"{disk.get('read_bytes', 0) / 2**20:.1f} MiB, corrupt files {disk.get('corrupt_files')}; "
        f"integrity checks {after['integrity_checks']}, failures {after['integrity_failures']}.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--policy", choices=["evict_only", "write_through"], default="evict_only")
    parser.add_argument("--disk-dir", default="", help="the disk tier's directory (default: a fresh temporary one)")
    parser.add_argument("server_args", nargs="*", help="more parallm-launch flags (after --)")
    add_results_options(parser, "restart")
    args = parser.parse_args(argv)
    results = Results.from_args("kv-disk", args, argv)
    record = run(args, args.server_args)
    record["command"] = results.command
    results.write(record, markdown(record))
    print(json.dumps({k: record[k] for k in ("ttft_cold_median_s", "ttft_warm_median_s", "warm_over_cold", "met",
                                             "same_tokens_after_restart")}))
    print(f"wrote {results.json}")
    return 0 if record["met"] and all(record["same_tokens_after_restart"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
