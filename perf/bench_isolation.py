"""Issue 30's canary: a short completion's latency while another client attacks the server.

A canary client sends 2-token completions one after another; its latency is measured idle, then while
each attack runs: a 6k-token uncached prompt (the long-prefill case: goal <= 2 s p99 on a CPU), the same
prompt again with prompt_logprobs 20 (recomputed whole, 8.5 MB of logprobs out), a
64 KiB grammar constraint (the most engine.max_constraint_bytes lets through; compiled off the step
loop), a 7.5 MB prompt (refused before it is tokenized whole), and a 1,024 x 2,000-id request (refused
by server.max_request_prompt_tokens). Goal: each attack's canary p99 at most 2x the idle p99 (the
long prefill: at most 2 s). The default model, one server, default settings.

    python -m perf.bench_isolation [--canaries 20]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import threading
import time
from typing import Any, Callable

import httpx

from perf.harness import Results, Server, add_results_options


def canary(url: str, count: int) -> list[float]:
    times = []
    with httpx.Client(base_url=url, timeout=300) as c:
        for i in range(count):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 2, "temperature": 0})
            r.raise_for_status()
            times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"n": len(times), "p50_s": round(statistics.median(ordered), 4),
            "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4), "max_s": round(ordered[-1], 4)}


def under(url: str, attack: Callable[[httpx.Client], Any], count: int) -> tuple[dict[str, float], Any]:
    """The canary's latencies while `attack` runs (started first; the canary starts 0.3 s later)."""
    out: dict[str, Any] = {}

    def run() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            t0 = time.perf_counter()
            r = attack(c)
            out["status"], out["attack_s"] = r.status_code, round(time.perf_counter() - t0, 3)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)
    times = canary(url, count)
    thread.join()
    return summary(times), out


LONG_PROMPT = [[(7 * i) % 40000 + 100 for i in range(6000)]]

ATTACKS: dict[str, Callable[[httpx.Client], Any]] = {
    "long_prefill_6k": lambda c: c.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1}),
    # the same prompt again with prompt_logprobs: never from the prefix cache, 20 alternatives a position
    "prompt_logprobs_6k": lambda c: c.post("/v1/completions", json={
        "prompt": LONG_PROMPT, "max_tokens": 1, "prompt_logprobs": 20}),
    "constraint_64k": lambda c: c.post("/v1/completions", json={
        "prompt": "Pick one:", "max_tokens": 4,
        "structured_outputs": {"choice": [f"option number {i:05d}" for i in range(2800)]}}),
    "prompt_7_5mb": lambda c: c.post("/v1/completions", json={
        "prompt": "The quick brown fox jumps over the lazy dog. " * 170_000, "max_tokens": 1}),
    "prompts_1024x2000": lambda c: c.post("/v1/completions", json={
        "prompt": [[5] * 2000] * 1024, "max_tokens": 1}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_isolation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, default=20, help="canary requests per phase (%(default)s)")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="attacks to run, comma-separated (%(default)s)")
    parser.add_argument("--server-args", default="", help="extra parallm-launch arguments, e.g. "
                        "'--engine.prefill-pass-s 0' (pacing off)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("isolation", args, argv)
    data: dict[str, Any] = {}
    with Server(*shlex.split(args.server_args)) as srv:
        canary(srv.url, 5)  # warm-up
        data["idle"] = summary(canary(srv.url, args.canaries))
        for name in args.attacks.split(","):
            attack = ATTACKS[name]
            lat, out = under(srv.url, attack, args.canaries)
            data[name] = {**lat, **out, "p99_over_idle": round(lat["p99_s"] / data["idle"]["p99_s"], 2)}
            print(name, json.dumps(data[name]), flush=True)
    lines = ["| phase | canary p50 s | p99 s | p99 / idle p99 | attack status | attack s |", "|---|---:|---:|---:|---:|---:|"]
    for name, row in data.items():
        lines.append(f"| {name} | {row['p50_s']} | {row['p99_s']} | {row.get('p99_over_idle', 1.0)} | "
                     f"{row.get('status', '')} | {row.get('attack_s', '')} |")
    print(results.write(data, "\n".join(lines)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
