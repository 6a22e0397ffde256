"""Issue 34's figures: the policy stage's act round trip at batch 1 over ZeroMQ and HTTP, less the bare
forward (goal: at most 1 ms over ZeroMQ), and actions/s with 256 environments acting at once.

A CartPole-sized MLP policy (4 observations, two hidden layers of 64, 2 actions, a value head) served
by `parallm-launch --policy-model` alone (no language model), per `--flush-us` setting:
- bare: `Policy.act` in this process at batch 1 (one forward, the draw, the log-prob);
- zmq / http: one act request at a time, batch 1 (PolicyClient; httpx with keep-alive);
- envs256: 256 environments stepping independently, each with one act of one row in flight (asyncio
  tasks over one AsyncPolicyClient), the stage batching them; vec256: one request of 256 rows at a time.

    python -m perf.bench_policy [--flush-us 0,200] [--requests 2000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from parallm.policies import Policy, save_policy
from parallm.policies.client import AsyncPolicyClient, PolicyClient, act_message
from parallm.policies.rng import row_seeds
from perf.harness import Results, Server, add_results_options, cpu_delta
from perf.loadgen import percentile

SPEC = {"format": "parallm-policy/1", "inputs": {"obs": {"shape": [None, 4]}},
        "network": {"blocks": [{"type": "mlp", "sizes": [64, 64], "activation": "tanh"}]},
        "action": {"type": "categorical", "n": 2}, "value": True}


def pcts(times: list[float]) -> dict[str, float]:
    """p50 and p99 in µs, interpolated as every other benchmark reports them (loadgen.percentile)."""
    return {"n": len(times), "p50_us": round(percentile(times, 0.5) * 1e6, 1),
            "p99_us": round(percentile(times, 0.99) * 1e6, 1)}


def timed(call: Any, count: int) -> list[float]:
    for _ in range(min(200, count)):
        call()
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def bare(policy: Policy, count: int) -> dict[str, float]:
    obs = {"obs": np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32)}
    return pcts(timed(lambda: policy.act(obs, {}, row_seeds(1, 1), np.zeros(1, bool)), count))


def zmq_batch1(address: str, count: int) -> dict[str, float]:
    obs = np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32)
    with PolicyClient(address) as client:
        return pcts(timed(lambda: client.act("bench", obs), count))


def http_batch1(url: str, count: int) -> dict[str, float]:
    body = {"model": "bench", "observations": [[0.01, -0.02, 0.03, 0.04]]}
    with httpx.Client(base_url=url, timeout=60) as c:
        return pcts(timed(lambda: c.post("/v1/rl/act", json=body).raise_for_status(), count))


async def envs(address: str, n_envs: int, seconds: float) -> dict[str, float]:
    """Actions per second with `n_envs` environments, each with one single-row act in flight."""
    client = AsyncPolicyClient(address, timeout=60)
    rng = np.random.default_rng(0)
    obs = [rng.normal(size=(1, 4)).astype(np.float32) for _ in range(n_envs)]
    done = 0
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def env(i: int) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            reply = await client.act(act_message("bench", obs[i]))
            latencies.append(time.perf_counter() - t0)
            obs[i] = obs[i] * 0.99 + 0.01 * float(reply.actions.data[0])
            done += 1

    await asyncio.gather(*(env(i) for i in range(min(n_envs, 8))))   # warm-up, then the measured run
    done, latencies, stop = 0, [], time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(env(i) for i in range(n_envs)))
    elapsed = time.perf_counter() - t0
    client.close()
    return {"envs": n_envs, "actions_per_s": round(done / elapsed), **pcts(latencies)}


def vectorized(address: str, rows: int, seconds: float) -> dict[str, float]:
    obs = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)
    with PolicyClient(address) as client:
        times = []
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            client.act("bench", obs)
            times.append(time.perf_counter() - t0)
    return {"rows": rows, "actions_per_s": round(rows * len(times) / sum(times)), **pcts(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_policy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flush-us", default="0,200", help="policies.flush_us settings to run (%(default)s)")
    parser.add_argument("--requests", type=int, default=2000, help="batch-1 requests per transport (%(default)s)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput run (%(default)s)")
    parser.add_argument("--envs", type=int, default=256, help="concurrent environments (%(default)s)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("policy", args, argv)
    work = Path(tempfile.mkdtemp(prefix="bench-policy-"))
    policy = Policy.load("bench", save_policy(work / "bench", SPEC, seed=0))
    data: dict[str, Any] = {"policy": SPEC, "bare_forward": bare(policy, args.requests), "runs": {}}
    print("bare", json.dumps(data["bare_forward"]), flush=True)
    for flush in [int(f) for f in args.flush_us.split(",")]:
        with Server("--policy-model", f"bench={work / 'bench'}", "--policies.flush-us", str(flush)) as srv:
            run: dict[str, Any] = {"zmq_batch1": zmq_batch1(srv.policy, args.requests),
                                   "http_batch1": http_batch1(srv.url, args.requests // 2)}
            for name in ("zmq_batch1", "http_batch1"):
                run[name]["p50_minus_bare_us"] = round(run[name]["p50_us"] - data["bare_forward"]["p50_us"], 1)
            before, client_before, t0 = srv.cpu_seconds(), time.process_time(), time.perf_counter()
            run["envs"] = asyncio.run(envs(srv.policy, args.envs, args.seconds))
            wall = time.perf_counter() - t0   # CPU share of the run: which side is the bottleneck
            run["envs"]["cpu_share"] = {"policy_stage": round(cpu_delta(before, srv.cpu_seconds()).get("policy", 0) / wall, 2),
                                        "client": round((time.process_time() - client_before) / wall, 2)}
            run["vectorized"] = vectorized(srv.policy, args.envs, args.seconds)
            data["runs"][str(flush)] = run
            print(f"flush_us={flush}", json.dumps(run), flush=True)
    bare_p50 = data["bare_forward"]["p50_us"]
    data["load_average"] = [round(x, 2) for x in os.getloadavg()]
    lines = [f"Machine load average at the end: {data['load_average']} on {os.cpu_count()} cores.",
             f"Bare forward at batch 1 (in process): p50 {bare_p50} us, p99 {data['bare_forward']['p99_us']} us.", "",
             "| flush_us | zmq p50 / p99 us | zmq p50 - bare | http p50 / p99 us | http p50 - bare | "
             f"{args.envs} envs actions/s (p50 / p99 us) | CPU share stage / client | 1 x {args.envs} rows actions/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for flush, run in data["runs"].items():
        z, h, e, v = run["zmq_batch1"], run["http_batch1"], run["envs"], run["vectorized"]
        lines.append(f"| {flush} | {z['p50_us']} / {z['p99_us']} | {z['p50_minus_bare_us']} | {h['p50_us']} / "
                     f"{h['p99_us']} | {h['p50_minus_bare_us']} | {e['actions_per_s']} ({e['p50_us']} / {e['p99_us']}) "
                     f"| {e['cpu_share']['policy_stage']} / {e['cpu_share']['client']} | {v['actions_per_s']} |")
    print(results.write(data, "\n".join(lines)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
