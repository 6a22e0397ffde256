"""Waves of streaming HTTP requests against a fresh server each: does the engine survive them?

Issue 24's failure: in one of eight waves of 512 streaming `/v1/chat/completions` requests at
c=256 on an H100 the engine stage died with a RuntimeError and failed every request in flight.
This runs `--waves` such waves, each on a fresh `parallm-launch`, and records per wave the
throughput, the failed requests and their errors, the engine restarts the supervisor announced, and
every traceback the server printed (the cause, when one happens).

    python -m perf.stress_waves --shape llama-3.2-3b --waves 10 --requests 512 --concurrency 256 \\
        --tokenizer-dir .gpu-tok --client-procs 4          # -> perf/results/stress-waves-llama-3.2-3b-h100.json
    python -m perf.stress_waves --shape tiny --waves 2 --requests 64 --concurrency 32 --out /tmp/w.json  # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from perf.harness import Results, Server, add_results_options, cpu_delta
from perf.loadgen import WORKLOADS, Workload, run_http


def tracebacks(lines: list[str]) -> list[str]:
    """Every traceback in a server's output (the line before it, the frames, the exception line);
    the supervisor prefixes each stage's lines with `[stage] `."""
    bare = [ln.split("] ", 1)[1] if ln.startswith("[") and "] " in ln else ln for ln in lines]
    found, i = [], 0
    while i < len(bare):
        if "Traceback (most recent call last)" in bare[i]:
            j = i + 1
            while j < len(bare) and (bare[j].startswith((" ", "\t")) or "Traceback" in bare[j]
                                     or "During handling" in bare[j] or "direct cause" in bare[j] or not bare[j]):
                j += 1
            found.append("\n".join(lines[max(0, i - 1):j + 1]))
            i = j + 1
        else:
            i += 1
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="a perf.bench_gpu shape (random weights, default tokenizer)")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--tokenizer-dir", default="")
    parser.add_argument("--waves", type=int, default=10)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no wave after this many seconds")
    parser.add_argument("--stop-on-failure", action="store_true", help="no more waves after a failed one")
    parser.add_argument("--server-args", default="", help="extra parallm-launch arguments")
    add_results_options(parser)
    args = parser.parse_args(argv)

    from perf.bench_serving import shape_model_dir

    began = time.monotonic()
    model_dir = shape_model_dir(args)
    workload = Workload(**{**WORKLOADS["chat"].__dict__, "max_tokens": args.max_tokens, "requests": args.requests})
    waves: list[dict[str, Any]] = []
    for k in range(args.waves):
        if args.deadline_s and time.monotonic() - began > args.deadline_s:
            break
        server = Server("--model.path", str(model_dir), "--engine.max-num-seqs", str(args.concurrency),
                        "--model.served-name", "bench", *args.server_args.split(), ready_timeout=600).start()
        try:
            before = server.cpu_seconds()
            r = asyncio.run(run_http(server.url, "bench", workload, args.concurrency, [2], seed=1000 * k,
                                     procs=args.client_procs))
            r["server_cpu_s"] = cpu_delta(before, server.cpu_seconds())
        finally:
            server.stop()
        lines = server.lines
        wave = {"wave": k, "tok_s": r["throughput_tok_s"], "ok": r["ok"], "requests": r["requests"],
                "errors": r["errors"], "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"], "wall_s": r["wall_s"],
                "server_cpu_s": r["server_cpu_s"], "client_cpu_s": r.get("client_cpu_s"),
                "restarts": [ln for ln in lines if "restart" in ln.lower()][:10],
                "tracebacks": tracebacks(lines)[:5]}
        if r["ok"] < r["requests"] or wave["tracebacks"]:
            wave["log_tail"] = [ln for ln in lines if not ln.startswith("[ingress]")][-400:]
        waves.append(wave)
        print(json.dumps(wave), flush=True)
        if args.stop_on_failure and "log_tail" in wave:
            break
    failed = [w["wave"] for w in waves if w["ok"] < w["requests"] or w["tracebacks"]]
    result = {"shape": args.shape, "requests": args.requests, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "waves": waves, "failed_waves": failed}
    md = [f"# {len(waves)} waves of {args.requests} streaming requests at c={args.concurrency} ({args.shape})", "",
          "| wave | tok/s | ok | TTFT p50 s | TTFT p99 s | tracebacks |", "|---|---|---|---|---|---|",
          *(f"| {w['wave']} | {w['tok_s']:.0f} | {w['ok']}/{w['requests']} | {w['ttft_p50_s']:.2f} | {w['ttft_p99_s']:.2f} | "
            f"{len(w['tracebacks'])} |" for w in waves), "", f"Failed waves: {failed or 'none'}"]
    Results.from_args("stress-waves", args, argv, experiment=args.shape).write(result, "\n".join(md))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
