"""What the benchmarks' HTTP client costs per streamed event: httpx against the lean client
(perf/sse_client.py), on asyncio's loop and on uvloop.

A benchmark's client processes share the host with the server they measure, so every CPU second they
spend per event is one the server's stages and its engine's launches cannot have (issue 37: on the H200
the served engine's host-bound decode steps ran ~10 % slower beside the client processes and the other
stages). Here the server is a canned one in a process of its own: it answers every POST with the same
pre-rendered stream of chat.completion.chunk events, one HTTP chunk each (as uvicorn writes them), so the
client's CPU is all that is measured. Each client runs the closed loop perf.loadgen runs (same request
body, same per-event parsing and timing) in a process of its own, one after another, `--rounds` times.

    python -m perf.bench_sse_client --concurrency 32 --requests 256 --events 128 --rounds 3
        # -> perf/results/sse-client-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from perf.harness import Results, add_results_options, free_port
from perf.loadgen import Workload, make_prompts

EVENT = (b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764590000,'
         b'"model":"bench","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,'
         b'"finish_reason":null}]}\n\n')
USAGE = (b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764590000,'
         b'"model":"bench","choices":[],"usage":{"prompt_tokens":48,"completion_tokens":%d,"total_tokens":%d}}\n\n')
CLIENTS = (("httpx", "asyncio"), ("lean", "asyncio"), ("lean", "uvloop"))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def canned_response(events: int) -> bytes:
    """The whole response to one request: head, `events` token events, the usage event, [DONE]."""
    body = _chunk(EVENT) * events + _chunk(USAGE % (events, events + 48)) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body)


def serve(port: int, events: int, ready: Any) -> None:
    """The canned server: every request on a connection gets the same response, written at once."""
    response = canned_response(events)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def client_run(url: str, concurrency: int, requests: int, events: int, http_client: str, loop: str) -> dict[str, Any]:
    """One closed loop in this process: CPU and wall seconds, events read, and whether every request ended."""
    from perf.loadgen import _http_closed_loop

    workload = Workload("canned", prompt_words=40, max_tokens=events, requests=requests)
    items = list(enumerate(make_prompts(workload)))
    if http_client == "httpx":
        import httpx  # noqa: F401 - imported before the clock starts
    factory = None
    if loop == "uvloop":
        import uvloop
        factory = uvloop.new_event_loop
    cpu, wall = time.process_time(), time.perf_counter()
    with asyncio.Runner(loop_factory=factory) as runner:
        records = runner.run(_http_closed_loop(url, "bench", workload, items, concurrency, [2], 0, http_client))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    ok = [r for r in records if r.ok]
    return {"cpu_s": cpu, "wall_s": wall, "events": sum(r.tokens for r in ok), "ok": len(ok),
            "requests": len(records), "errors": sorted({r.error for r in records if not r.ok})[:3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--events", type=int, default=128, help="token events per response")
    parser.add_argument("--rounds", type=int, default=3)
    add_results_options(parser)
    args = parser.parse_args(argv)
    clients = [c for c in CLIENTS if c[1] != "uvloop" or _has_uvloop()]
    results = Results.from_args("sse-client", args, argv)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ready = ctx.Event()
    server = ctx.Process(target=serve, args=(port, args.events, ready), daemon=True)
    server.start()
    runs: list[dict[str, Any]] = []
    try:
        if not ready.wait(30):
            raise RuntimeError("the canned server did not start")
        url = f"http://127.0.0.1:{port}"
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            for r in range(args.rounds):
                for http_client, loop in clients:
                    run = pool.submit(client_run, url, args.concurrency, args.requests, args.events, http_client,
                                      loop).result()
                    run.update(round=r, client=http_client, loop=loop,
                               cpu_us_per_event=1e6 * run["cpu_s"] / max(1, run["events"]))
                    runs.append(run)
                    print(f"round {r} {http_client}/{loop}: {run['cpu_us_per_event']:.1f} µs CPU per event, "
                          f"{run['events'] / run['wall_s']:,.0f} events/s, {run['ok']}/{run['requests']} ok",
                          file=sys.stderr)
    finally:
        server.kill()
    summary = {f"{c}/{lp}": statistics.median(x["cpu_us_per_event"] for x in runs if (x["client"], x["loop"]) == (c, lp))
               for c, lp in clients}
    doc = {"concurrency": args.concurrency, "requests": args.requests, "events": args.events, "runs": runs,
           "median_cpu_us_per_event": summary}
    lines = [f"# HTTP client CPU per streamed event ({args.concurrency} streams, {args.requests} requests of "
             f"{args.events} events, {args.rounds} rounds)", "", f"`{results.command}`", "",
             "| client | loop | CPU µs per event (median) | runs |", "|---|---|---:|---|"]
    for c, lp in clients:
        each = ", ".join(f"{x['cpu_us_per_event']:.1f}" for x in runs if (x["client"], x["loop"]) == (c, lp))
        lines.append(f"| {c} | {lp} | {summary[f'{c}/{lp}']:.1f} | {each} |")
    results.write(doc, "\n".join(lines))
    print("\n".join(lines))
    return 0 if all(x["ok"] == x["requests"] for x in runs) else 1


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
