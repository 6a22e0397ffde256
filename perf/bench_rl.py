"""RL path benchmark: what the ZeroMQ pipeline adds to a 1-token generation, and group rollout throughput.

1. In-process: parallm.engine.Engine on the model parallm.models.load_model gives the server, one request
   of max_tokens=1 at a time (add_request, step until it finishes) — the floor.
2. The same through a running parallm-launch (started here): the raw ZeroMQ client
   (parallm.client.Client.generate, token ids straight to the engine) and HTTP POST /generate.
3. Rollout throughput for groups of 8 prompts x 8 samples (temperature 1, ignore_eos): in-process,
   raw client (generate_group) and HTTP /generate (TRL shape, one request per group).

    PYTHONPATH=$PWD python -m perf.bench_rl   # -> perf/results/rl-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from perf.harness import Results, Server, add_results_options, describe

PROMPTS = [[1, 504, 3458, 282, 2], [1, 9690, 30], [1, 422, 5248, 314, 253, 1694, 28], [1, 19, 2], [1, 1812],
           [1, 7306, 253, 2096, 282, 260, 2361], [1, 3120, 314, 11], [1, 532, 1178, 4120, 30, 216]]


def summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"p50_ms": round(statistics.median(s), 3), "p10_ms": round(s[len(s) // 10], 3),
            "p90_ms": round(s[(len(s) * 9) // 10], 3), "mean_ms": round(statistics.fmean(s), 3), "n": len(s)}


def in_process(iters: int, warmup: int, group_tokens: int, groups: int) -> dict:
    from parallm.config import Config
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.models import load_model
    from parallm.protocol import SamplingParams

    config = Config()
    loaded = load_model(config.model)
    engine = Engine(EngineModel.of(loaded), config)
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True)
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        engine.add_request(make_request(rid=uuid.uuid4().hex, prompt_ids=PROMPTS[0], params=one))
        while not any(o.finish_reason for o in engine.step()):
            pass
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    params = SamplingParams(max_tokens=group_tokens, temperature=1.0, ignore_eos=True, logprobs=True)
    rates = []
    for g in range(groups + 1):
        t0 = time.perf_counter()
        for p in PROMPTS:
            engine.add_request(make_request(rid=uuid.uuid4().hex, prompt_ids=p, params=params, n=8))
        tokens = 0
        while engine.has_work():
            tokens += sum(len(o.token_ids) for o in engine.step())
        if g:  # the first group warms up
            rates.append(tokens / (time.perf_counter() - t0))
    return {"one_token": summary(times), "group_tok_s": [round(r, 1) for r in rates]}


def served(iters: int, warmup: int, group_tokens: int, groups: int) -> dict:
    import httpx

    from parallm.client import Client
    from parallm.protocol import SamplingParams

    out: dict = {}
    # a generous dead-after: on a shared, loaded CPU a slow step must not get the engine restarted mid-run
    with Server("--engine.max-num-seqs", "64", "--supervisor.dead-after-s", "120") as server, Client(server.router, timeout=600) as client, \
            httpx.Client(base_url=server.url, timeout=600) as http:
        one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True)
        times, http_times = [], []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            [seq] = client.generate(PROMPTS[0], one)
            assert len(seq.token_ids) == 1
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1000)
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            r = http.post("/generate", json={"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0, "logprobs": 1})
            assert r.status_code == 200, r.text
            if i >= warmup:
                http_times.append((time.perf_counter() - t0) * 1000)
        out["raw_one_token"], out["http_one_token"] = summary(times), summary(http_times)
        params = SamplingParams(max_tokens=group_tokens, temperature=1.0, ignore_eos=True, logprobs=True)
        raw_rates, http_rates = [], []
        for g in range(groups + 1):
            t0 = time.perf_counter()
            results = client.generate_group(PROMPTS, params, n=8)
            tokens = sum(len(s.token_ids) for group in results for s in group)
            if g:
                raw_rates.append(tokens / (time.perf_counter() - t0))
        for g in range(groups):
            t0 = time.perf_counter()
            r = http.post("/generate/", json={"prompts": PROMPTS, "n": 8, "max_tokens": group_tokens,
                                              "temperature": 1.0, "generation_kwargs": {"ignore_eos": True}})
            assert r.status_code == 200, r.text
            http_rates.append(sum(map(len, r.json()["completion_ids"])) / (time.perf_counter() - t0))
        out["raw_group_tok_s"] = [round(r, 1) for r in raw_rates]
        out["http_group_tok_s"] = [round(r, 1) for r in http_rates]
    return out


def report_md(result: dict, results: Results) -> str:
    ip, sv = result["in_process"], result["served"]
    added = sv["raw_one_token"]["p50_ms"] - ip["one_token"]["p50_ms"]
    med = statistics.median
    m = results.machine
    lines = [
        f"# RL path on {m['gpu'] or 'the CPU'}: 1-token round trip and 8x8 group rollouts", "",
        f"Command: `{results.command}`  ",
        f"Machine: {describe(m)}; load average at start {result['loadavg_start']} and at end "
        f"{result['loadavg_end']}.", "",
        *(["**Noise:** the load average exceeded the core count while this ran (other work shared the "
           "machine); absolute numbers are inflated. Compare the rows with each other.", ""]
          if max(result["loadavg_start"][0], result["loadavg_end"][0]) > m["cpus"] else []),
        "| 1-token generation (default model, greedy) | p50 ms | p10 ms | p90 ms |", "|---|---|---|---|",
    ]
    for name, s in [("in-process Engine (add_request + step)", ip["one_token"]),
                    ("raw ZeroMQ client -> parallm-launch", sv["raw_one_token"]),
                    ("HTTP POST /generate -> parallm-launch", sv["http_one_token"])]:
        lines.append(f"| {name} | {s['p50_ms']} | {s['p10_ms']} | {s['p90_ms']} |")
    lines += ["", f"Added by the pipeline (raw client p50 - in-process p50): **{added:.3f} ms** "
              f"(goal: <= 1 ms).", "",
              f"| 8 prompts x 8 samples x {result['group_tokens']} tokens | tokens/s (median of runs) | runs |",
              "|---|---|---|",
              f"| in-process Engine | {med(ip['group_tok_s']):.1f} | {ip['group_tok_s']} |",
              f"| raw client generate_group | {med(sv['raw_group_tok_s']):.1f} | {sv['raw_group_tok_s']} |",
              f"| HTTP /generate (TRL shape) | {med(sv['http_group_tok_s']):.1f} | {sv['http_group_tok_s']} |", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--group-tokens", type=int, default=32)
    ap.add_argument("--groups", type=int, default=3)
    add_results_options(ap)
    args = ap.parse_args()
    from parallm import blas

    blas.reexec_with_openblas()  # the in-process engine gets the BLAS the served engine gets
    result = {"group_tokens": args.group_tokens, "loadavg_start": os.getloadavg()}
    result["in_process"] = in_process(args.iters, args.warmup, args.group_tokens, args.groups)
    result["served"] = served(args.iters, args.warmup, args.group_tokens, args.groups)
    result["loadavg_end"] = os.getloadavg()
    results = Results.from_args("rl", args)
    results.write(result, report_md(result, results))
    print(report_md(result, results))


if __name__ == "__main__":
    main()
