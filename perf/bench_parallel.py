"""Tensor-parallel ranks and data-parallel replicas against one engine process, over HTTP
(parallm-launch, perf/harness.py).

For each `--layouts` entry TPxR, a fresh server (`--engine.tensor-parallel TP --engine.replicas R`)
on a random-weight model of a perf.bench_gpu shape with the default model's tokenizer, then a closed
loop of streaming requests at each `--concurrency` (perf/loadgen.py: every request runs its full
length). Reports output tokens/s, TTFT and ITL percentiles per (layout, concurrency), and each
layout's speed-up over the first.

`--requests-per-stream K` sizes each run to its concurrency (max(--requests, K * c) requests), so
c=1 stays short and c=256 runs long enough to measure. `--publish-adapter-every S` publishes a new
version of a random LoRA (q_proj and o_proj of every layer) on the trainer's PUB socket, as the
default policy every request runs under, every S seconds during each run (perf/parallel_adapters.py);
after the run it reports the version each replica and each rank serves (replica 0's stats: its own,
EngineStats.replicas and .ranks), right at the end and once all reach the last one, and the
versions seen by probe requests sent one after another through the run (POST /generate).

On the 2-core CPU (ring backend, two local ranks; a smoke run, the CPU has no spare cores for a
second rank to speed anything up):

    python -m perf.bench_parallel --shape tiny --layouts 1x1,2x1,1x2 --concurrency 1,8 --max-tokens 32 \
        --requests 4 --requests-per-stream 2 --publish-adapter-every 0.5

On two H100s (`nvidia-h100-x2`, NCCL, one GPU per rank; NCCL_NVLS_ENABLE=0 is set for every rank),
after the wheels of /work/shared/GPU.md (mlx, mlx-cuda-13, mlx-lm, starlette, uvicorn, pyzmq, msgspec,
python-multipart, gguf) are in /tmp/gpu (its step 2), three calls, each one server start per layout
plus the shape's random weights (estimated 4-7 minutes each; none should reach 9):

    # 1. TP=2 vs TP=1, Llama-3.2-3B shape, c=1 (4 requests) and c=64 (256 requests)
    source .gpu/b/install.sh && python3 -m perf.bench_parallel --shape llama-3.2-3b --layouts 1x1,2x1 \
        --concurrency 1,64 --max-tokens 128 --requests 4 --requests-per-stream 4 --client-procs 4 \
        --publish-adapter-every 2 --tokenizer-dir TOKDIR --experiment tp-3b
    # 2. the same on the Qwen3-8B shape
    source .gpu/b/install.sh && python3 -m perf.bench_parallel --shape qwen3-8b --layouts 1x1,2x1 \
        --concurrency 1,64 --max-tokens 128 --requests 4 --requests-per-stream 4 --client-procs 4 \
        --publish-adapter-every 2 --tokenizer-dir TOKDIR --experiment tp-8b
    # 3. DP=2 vs one engine at c=256 (1024 requests); goal: 1x2 >= 1.8x 1x1
    source .gpu/b/install.sh && python3 -m perf.bench_parallel --shape llama-3.2-3b --layouts 1x1,1x2 \
        --concurrency 256 --max-tokens 128 --requests-per-stream 4 --client-procs 8 \
        --publish-adapter-every 2 --tokenizer-dir TOKDIR --experiment dp

(TOKDIR: the default model's tokenizer files, carried over as perf/bench_serving.py's --shape runs do.)
Measured on the 2-core CPU (tiny shape, 32 tokens; ring for tp=2; other work on the machine):
1x1 68 / 431 tok/s at c=1 / 8, 2x1 11 / 34, 1x2 56 / 269. Two cores cannot run two ranks or two
engines side by side faster than one, and each tensor-parallel layer's two all-sums cross TCP: on
a CPU this shows that the layouts serve, not a speed-up (the GPU runs above are the measurement).
With --publish-adapter-every 0.5 (the smoke command above): every version published during a run
reached every rank (2x1: v1..v30 at c=1, both ranks on v30 0.75 s after the run) and every replica
(1x2: replica 1's pushed stats lag replica 0's by up to a second, then both on the last version).

Tensor parallel's calls travel over ZeroMQ, not in an all-sum on the device (parallm/engine/distributed.py:
the all-sum waited for the pass launched the step before, undoing the engine's overlap; TP=2 was 0.20x
one engine at c=64 on two H200s). On this CPU, old code (5c28d7a) and new side by side, four pairs of
runs in alternating order, load average 4-10 from other work (so noisy):

    python -m perf.bench_parallel --shape tiny --layouts 1x1,2x1 --concurrency 1,8 --max-tokens 32 \
        --requests 4 --requests-per-stream 2

2x1 tok/s old -> new, pair by pair: c=8 26.1 -> 64.3, 18.8 -> 19.3, 51.0 -> 62.5, 63.6 -> 71.6 (new ahead
in all four); c=1 6.4 -> 10.2, 7.7 -> 4.4, 10.6 -> 15.8, 32.6 -> 23.0 (noise). On a CPU the ring
all-sums of every layer dominate and the calls' all-sum waited for little: this shows that nothing got slower
rather than the GPU's gain. The measurement that matters is the GPU's: call 1
above (TP=2 vs TP=1 on `nvidia-h100-x2`), against docs/performance.md's 0.20x at c=64.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from perf.harness import Results, Server, add_results_options
from perf.loadgen import WORKLOADS, Workload, run_http


def workload_for(max_tokens: int, requests: int) -> Workload:
    base = WORKLOADS["short"]
    return Workload("parallel", prompt_words=base.prompt_words, max_tokens=max_tokens, requests=requests)


def requests_at(c: int, requests: int, per_stream: int) -> int:
    """Requests of the run at concurrency `c`: at least `requests`, `per_stream` per stream, and c."""
    return max(requests, per_stream * c, c)


def serve_and_measure(model_dir: Path, layout: str, concurrency: list[int], workload: Workload, max_seqs: int,
                      client_procs: int, per_stream: int = 0, publish_every_s: float = 0.0) -> list[dict[str, Any]]:
    tp, replicas = (int(x) for x in layout.split("x"))
    rows = []
    with Server("--model.path", str(model_dir), "--model.served-name", "bench", "--engine.max-num-seqs",
                str(max_seqs), "--engine.tensor-parallel", str(tp), "--engine.replicas", str(replicas),
                ready_timeout=900) as server:
        asyncio.run(run_http(server.url, "bench", workload_for(4, 2), 2, [], 1))  # warm-up
        publishing = None
        if publish_every_s > 0:
            from perf.parallel_adapters import Publishing

            publishing = Publishing(server, model_dir, publish_every_s, replicas)
        try:
            for c in concurrency:
                w = Workload(workload.name, workload.prompt_words, workload.max_tokens,
                             requests_at(c, workload.requests, per_stream))

                def run(c=c, w=w) -> dict[str, Any]:
                    return asyncio.run(run_http(server.url, "bench", w, c, [], seed=c,
                                                procs=client_procs if c >= 16 else 1))

                if publishing is None:
                    r = run()
                else:
                    r, r["adapter"] = publishing.during(run)
                r.update(layout=layout, tp=tp, replicas=replicas, concurrency=c, requests=w.requests)
                print(f"{layout} c={c} ({w.requests} requests): {r['throughput_tok_s']:.1f} tok/s, TTFT p50 "
                      f"{1000 * r['ttft_p50_s']:.0f} ms, ITL p50 {1000 * r['itl_p50_s']:.1f} ms", flush=True)
                if publishing is not None:
                    print("  " + adapter_line(r["adapter"]), flush=True)
                rows.append(r)
        finally:
            if publishing is not None:
                publishing.close()
    return rows


def adapter_line(a: dict[str, Any]) -> str:
    """One line on the versions published during a run and where they landed."""
    where = ", ".join(f"r{s['replica']}/rank{s['rank']}=v{s['version']}" for s in a["served"])
    at_end = ", ".join(f"r{s['replica']}/rank{s['rank']}=v{s['version']}" for s in a["served_at_end"])
    return (f"adapter versions {a['published'][0]}..{a['published'][-1]} published; at the end of the run {at_end}; "
            f"all on v{a['published'][-1]} after {a['settled_s']} s: {where}; {a['probes']} probe requests saw "
            f"versions {a['probe_versions']} ({a['probes_switched_mid_request']} switched mid-request)")


def report(rows: list[dict[str, Any]]) -> str:
    base = {r["concurrency"]: r["throughput_tok_s"] for r in rows if r["layout"] == rows[0]["layout"]}
    lines = ["| tp x replicas | concurrency | output tok/s | vs first | TTFT p50 ms | ITL p50 ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["throughput_tok_s"] / base[r["concurrency"]] if base.get(r["concurrency"]) else float("nan")
        lines.append(f"| {r['layout']} | {r['concurrency']} | {r['throughput_tok_s']:.1f} | {ratio:.2f}x | "
                     f"{1000 * r['ttft_p50_s']:.0f} | {1000 * r['itl_p50_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="a perf.bench_gpu shape (random weights)")
    parser.add_argument("--layouts", default="1x1,2x1", help="TPxREPLICAS layouts, comma-separated (1x1 = one "
                        "engine process)")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least c)")
    parser.add_argument("--requests-per-stream", type=int, default=0, help="at least this many requests per "
                        "stream: a level of concurrency c runs max(--requests, K * c) requests")
    parser.add_argument("--publish-adapter-every", type=float, default=0.0, metavar="S",
                        help="publish a new LoRA version (the default policy) on the trainer's PUB socket every S "
                        "seconds during each run, and report the version every replica and rank serves")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--client-procs", type=int, default=1, help="HTTP client processes at c >= 16")
    parser.add_argument("--work-dir", default="", help="where --shape's model is built (reused if there)")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer files for --shape; default: the converted "
                        "default model's")
    add_results_options(parser, "", "the shape")
    args = parser.parse_args(argv)
    from perf.bench_serving import shape_model_dir

    results = Results.from_args("parallel", args, argv, experiment=args.shape)
    model_dir = shape_model_dir(args)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    workload = workload_for(args.max_tokens, args.requests)
    rows: list[dict[str, Any]] = []
    for layout in args.layouts.split(","):
        rows += serve_and_measure(model_dir, layout, concurrency, workload, args.max_num_seqs, args.client_procs,
                                  args.requests_per_stream, args.publish_adapter_every)
        results.write({"shape": args.shape, "rows": rows})
    md = report(rows)
    if args.publish_adapter_every > 0:
        md += "\n\n" + "\n".join(f"- {r['layout']} c={r['concurrency']}: {adapter_line(r['adapter'])}" for r in rows)
    results.write({"shape": args.shape, "rows": rows}, f"# bench_parallel ({args.shape})\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
