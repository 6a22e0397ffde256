"""Ingress' CPU cost per streamed event and per token, measured on the real stages.

Issue 24: at c=256 on the H200 the engine spent 14-16 s per wave of 65,536 tokens while ingress
spent 5-6 CPU s in fast waves and 12-16 in slow ones, so ingress' cost per SSE event sets the
served figure. This starts `parallm-launch` on the tiny random-weight shape (perf.bench_gpu's
`tiny`, the default model's vocabulary, so the detokenizer and the SSE path handle real text),
drives it with many streaming `/v1/chat/completions` requests from a cheap raw HTTP/1.1 client
(it counts `data:` events and reads the usage chunk; it parses no JSON per event, so it costs a
few µs per event beside the ~180 µs of an httpx client), and reports the CPU seconds ingress used
(/proc, `Server.cpu_seconds`) per event the clients received and per token generated.

`--source LABEL=DIR` (repeatable) serves the same workload from other checkouts, one after another
in the same run, for a before/after on one machine: DIR is a checkout (e.g. a `git worktree` of
the base commit) whose `parallm/stages` and `parallm/launch` resolve (the script links them).
`--profile` runs ingress under cProfile (PARALLM_PROFILE_INGRESS) and prints its top functions.

    python -m perf.bench_ingress --concurrency 256 --requests 512 --max-tokens 64 \\
        --source base=/tmp/ingress-base            # -> perf/results/ingress-cpu.json

On a GPU machine the same measurement at the real rates (`bash perf/gpu_runs.sh ingress`):

    python -m perf.bench_ingress --shape llama-3.2-3b --tokenizer-dir .gpu-tok --concurrency 256 \\
        --requests 512 --max-tokens 128 --rounds 4 --experiment llama-3.2-3b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from perf.harness import Results, Server, add_results_options, cpu_delta
from perf.loadgen import Workload, make_prompts

EOS_IDS = (0, 1, 2)
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


async def _one(port: int, body: bytes) -> tuple[int, int, float]:
    """One streamed request on its own connection: (events, completion tokens, seconds)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = bytearray()
    events = 0
    while chunk := await reader.read(1 << 16):
        events += chunk.count(b"data: ")  # an event split between two reads is counted by its start
        data += chunk
    writer.close()
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"request failed: {head[:200]!r} {rest[:300]!r}")
    usage = COMPLETION_TOKENS.findall(rest)
    tokens = int(usage[-1]) if usage else 0
    return events - 1, tokens, time.perf_counter() - start  # less the [DONE] event


async def drive(port: int, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """A closed loop of `concurrency` streams over `prompts`."""
    queue = list(reversed(prompts))
    done: list[tuple[int, int, float]] = []

    async def worker() -> None:
        while queue:
            body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": queue.pop()}],
                               "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True},
                               "logit_bias": {str(t): -100 for t in EOS_IDS}}).encode()
            done.append(await _one(port, body))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    events, tokens = sum(d[0] for d in done), sum(d[1] for d in done)
    return {"requests": len(done), "events": events, "tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 1)}


def stall(pid: int, stall_ms: float, every_ms: float, stop: threading.Event) -> None:
    """SIGSTOP `pid` for `stall_ms` every `every_ms` until `stop` is set."""
    while not stop.wait(max(0.0, every_ms - stall_ms) / 1000):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stall_ms / 1000)
        os.kill(pid, signal.SIGCONT)


def user_sys(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds so far (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def linked_checkout(path: str) -> str:
    """DIR as an import root whose parallm.stages / parallm.launch are its stages/ and launch/ (as installed)."""
    root = Path(path).resolve()
    for sub in ("stages", "launch"):
        link = root / "parallm" / sub
        if not link.exists():
            link.symlink_to(root / sub, target_is_directory=True)
    return str(root)


def checkouts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(label, import root) of each `--source LABEL=DIR`, then (args.label, None) for this checkout."""
    sources: list[tuple[str, str | None]] = []
    for spec in args.source:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"--source wants LABEL=DIR, not {spec!r}")
        sources.append((label, linked_checkout(path)))
    return [*sources, (args.label, None)]


def run_source(label: str, root: str | None, model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    env = dict(os.environ)
    profile = ""
    if args.profile:
        profile = env["PARALLM_PROFILE_INGRESS"] = str(Path(tempfile.mkdtemp()) / f"ingress-{label}.prof")
    server = Server("--model.path", str(model_dir), "--engine.max-num-seqs", str(args.concurrency),
                    "--model.served-name", "bench", "--server.max-concurrent-requests", str(args.concurrency * 2),
                    *args.server_args.split(), env=env, ready_timeout=600)
    if root is not None:  # that checkout's code for every stage, not this one's
        server.env["PYTHONPATH"] = root  # and its working directory: `python -m` looks there first
        server.argv = ["env", "-C", root, sys.executable, "-m", "parallm.launch", *server.argv[1:]]
    server.start()
    rows = []
    try:
        warm = make_prompts(Workload("warm", prompt_words=40, max_tokens=8, requests=8), 99)
        asyncio.run(drive(server.port, warm, 8, 8))
        for r in range(args.rounds):
            prompts = make_prompts(Workload("ingress", prompt_words=40, max_tokens=args.max_tokens,
                                            requests=args.requests), 1000 + r)
            ingress_pid = next(pid for name, _, pid in server.stage_processes() if name == "ingress")
            before, split = server.cpu_seconds(), user_sys(ingress_pid)
            stop = threading.Event()
            if args.stall_ms:  # ingress stopped now and then: a backlog of outputs, as when it falls behind
                threading.Thread(target=stall, args=(ingress_pid, args.stall_ms, args.stall_every_ms, stop),
                                 daemon=True).start()
            try:
                row = asyncio.run(drive(server.port, prompts, args.concurrency, args.max_tokens))
            finally:
                stop.set()
            cpu = cpu_delta(before, server.cpu_seconds())
            row["ingress_user_sys_s"] = [round(b - a, 2) for a, b in zip(split, user_sys(ingress_pid))]
            ingress = cpu.get("ingress", 0.0)
            row.update(source=label, round=r, stage_cpu_s=cpu, ingress_cpu_s=round(ingress, 3),
                       ingress_us_per_event=round(1e6 * ingress / max(1, row["events"]), 1),
                       ingress_us_per_token=round(1e6 * ingress / max(1, row["tokens"]), 1),
                       tokens_per_event=round(row["tokens"] / max(1, row["events"]), 3))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if profile:  # ingress writes its profile on SIGUSR2
            for name, _, pid in server.stage_processes():
                if name == "ingress":
                    os.kill(pid, signal.SIGUSR2)
            time.sleep(2.0)
        server.stop()
    if profile and Path(profile).exists():
        print(f"--- ingress profile ({label}): {profile}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile_top)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="a perf.bench_gpu shape (random weights, default tokenizer)")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--tokenizer-dir", default="")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per source (after a warm-up)")
    parser.add_argument("--source", action="append", default=[],
                        help="LABEL=DIR: also serve from checkout DIR (run first, before this checkout)")
    parser.add_argument("--label", default="this", help="this checkout's label")
    parser.add_argument("--server-args", default="", help="extra parallm-launch arguments")
    parser.add_argument("--stall-ms", type=float, default=0.0,
                        help="stop ingress (SIGSTOP) this long every --stall-every-ms: a backlog, as when it falls "
                             "behind the engine")
    parser.add_argument("--stall-every-ms", type=float, default=500.0)
    parser.add_argument("--profile", action="store_true", help="cProfile ingress; print its top functions")
    parser.add_argument("--profile-top", type=int, default=30)
    add_results_options(parser)
    args = parser.parse_args(argv)

    from perf.bench_serving import shape_model_dir

    model_dir = shape_model_dir(args)
    results = Results.from_args("ingress", args, argv)
    sources = checkouts(parser, args)
    rows: list[dict[str, Any]] = []
    for label, root in sources:
        rows += run_source(label, root, model_dir, args)
        results.write({"shape": args.shape, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                       "rows": rows})
    summary = {}
    for label, _ in sources:
        mine = [r for r in rows if r["source"] == label]
        summary[label] = {key: round(sum(r[key] for r in mine) / len(mine), 2)
                          for key in ("ingress_us_per_event", "ingress_us_per_token", "tokens_per_event", "tok_s")}
    results.write({"shape": args.shape, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                   "rows": rows, "summary": summary})
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
