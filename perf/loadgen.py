"""Load generator: fixed-seed workloads over OpenAI HTTP streaming or the raw ZeroMQ client.

Reports output throughput and time-to-first-token / inter-token latency percentiles as JSON.
Every request is made to run its full length (the end-of-sequence token is suppressed with
logit_bias, which mlx_lm.server also honours), so servers are compared on equal work.

    python -m perf.loadgen --url http://127.0.0.1:8000 --workload chat --concurrency 16
    python -m perf.loadgen --router ipc:///tmp/parallm-x/router.sock --workload rl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

WORDS = ("the of and to in is that for it as with was on be by at this had not are but from or have an they "
         "which one you were all we her she there would their will when who him been has more if no out so said "
         "what up its about than into them can only other new some could time these two may then do first any my "
         "now such like our over man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make world "
         "still own see men work long get here between both life being under never day same another know while last "
         "might us great old year off come since against go came right used take three river garden light music").split()


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_words: int          # approximate prompt length
    max_tokens: int
    requests: int
    n: int = 1                 # samples per request (RL groups)
    shared_prefix_words: int = 0
    chat: bool = True


WORKLOADS = {
    "chat": Workload("chat", prompt_words=40, max_tokens=128, requests=64),
    "short": Workload("short", prompt_words=40, max_tokens=64, requests=64),
    "rl": Workload("rl", prompt_words=60, max_tokens=256, requests=8, n=8, chat=False),
    "shared_prefix": Workload("shared_prefix", prompt_words=30, max_tokens=32, requests=32,
                              shared_prefix_words=750),
    "long_context": Workload("long_context", prompt_words=1500, max_tokens=64, requests=8),
}


def make_prompts(workload: Workload, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(workload.shared_prefix_words))
    prompts = []
    for i in range(workload.requests):
        body = " ".join(rng.choice(WORDS) for _ in range(workload.prompt_words))
        text = f"Request {i}: continue this text. {body}"
        prompts.append(f"{prefix}\n\n{text}" if prefix else text)
    return prompts


@dataclass
class RequestRecord:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    started: float = 0.0       # wall clock (time.time()) when it was sent; 0 where not recorded


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(records: list[RequestRecord], wall: float, workload: Workload, concurrency: int,
              target: str) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    return {
        "target": target, "workload": workload.name, "concurrency": concurrency,
        "requests": len(records), "ok": len(ok), "errors": sorted({r.error for r in records if not r.ok})[:5],
        "output_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_s": percentile(itls, 0.5), "itl_p99_s": percentile(itls, 0.99),
        "latency_p50_s": percentile([r.latency for r in ok], 0.5),
        **steady_state(ok, concurrency),
    }


def steady_state(records: list[RequestRecord], concurrency: int) -> dict[str, float]:
    """Output tokens/s in the window where every stream is running: from the first token of the last of
    the first `concurrency` requests to the first end after the last request was sent (the run's ramp-up
    and tail left out). {} without send times or with fewer requests than 2 * concurrency."""
    if len(records) < 2 * concurrency or any(not r.started for r in records):
        return {}
    by_start = sorted(records, key=lambda r: r.started)
    full = max(r.started + r.ttft for r in by_start[:concurrency])
    last_sent = by_start[-1].started
    drain = min((r.started + r.latency for r in records if r.started + r.latency > last_sent), default=0.0)
    if drain <= full:
        return {}
    tokens = 0.0
    for r in records:
        per_event = r.tokens / (1 + len(r.itls))  # an event can carry several tokens of a stream behind
        at = r.started + r.ttft
        for gap in (0.0, *r.itls):
            at += gap
            tokens += per_event if full <= at < drain else 0.0
    return {"steady_tok_s": tokens / (drain - full), "steady_window_s": drain - full,
            "steady_from_s": full - by_start[0].started}


# ---------------------------------------------------------------------------- HTTP

def _http_request(model: str, prompt: str, workload: Workload, eos_ids: list[int], seed: int) -> tuple[str, dict]:
    """(path, body) of one streaming request of the workload."""
    body: dict[str, Any] = {"model": model, "max_tokens": workload.max_tokens, "stream": True,
                            "temperature": 0.0, "stream_options": {"include_usage": True},
                            "logit_bias": {str(t): -100 for t in eos_ids}}
    if workload.n > 1:
        # a seed only where sampling uses it: mlx_lm.server serves seeded requests one at a time
        body.update(n=workload.n, temperature=1.0, seed=seed)
    if workload.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


class _StreamClock:
    """Times one streamed response event by event: TTFT at the first event that carries text, an ITL
    between each two; the usage event's completion_tokens (else the count of text events) as its tokens."""

    def __init__(self, record: RequestRecord) -> None:
        self.record, self.start, self.last, self.chunks = record, time.perf_counter(), 0.0, 0

    def event(self, payload: dict[str, Any]) -> None:
        if payload.get("usage"):
            self.record.tokens = payload["usage"]["completion_tokens"]
        choices = payload.get("choices") or []
        if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
            now = time.perf_counter()
            if self.chunks:
                self.record.itls.append(now - self.last)
            else:
                self.record.ttft = now - self.start
            self.last = now
            self.chunks += 1

    def done(self) -> RequestRecord:
        self.record.latency = time.perf_counter() - self.start
        self.record.tokens = self.record.tokens or self.chunks
        self.record.ok = True
        return self.record


async def _http_one(client, url: str, model: str, prompt: str, workload: Workload, eos_ids: list[int],
                    seed: int) -> RequestRecord:
    """One request through httpx (`client`: an httpx.AsyncClient)."""
    path, body = _http_request(model, prompt, workload, eos_ids, seed)
    record = RequestRecord(ok=False, started=time.time())
    clock = _StreamClock(record)
    try:
        async with client.stream("POST", url + path, json=body, timeout=3600) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}"
                await response.aread()
                return record
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    clock.event(json.loads(line[6:]))
    except Exception as exc:  # noqa: BLE001 - a benchmark records every failure
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    return clock.done()


async def _lean_one(client, model: str, prompt: str, workload: Workload, eos_ids: list[int],
                    seed: int) -> RequestRecord:
    """One request through the lean client (`client`: a perf.sse_client.SSEClient)."""
    import msgspec

    from perf.sse_client import HTTPStatusError

    path, body = _http_request(model, prompt, workload, eos_ids, seed)
    record = RequestRecord(ok=False, started=time.time())
    clock = _StreamClock(record)
    decode = msgspec.json.decode
    try:
        async for data in client.post_events(path, msgspec.json.encode(body)):
            if data != b"[DONE]":
                clock.event(decode(data))
    except HTTPStatusError as exc:
        record.error = f"HTTP {exc.status}"
        return record
    except Exception as exc:  # noqa: BLE001 - a benchmark records every failure
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    return clock.done()


HTTP_CLIENTS = ("lean", "httpx")


async def _http_closed_loop(url: str, model: str, workload: Workload, items: list[tuple[int, str]],
                            concurrency: int, eos_ids: list[int], seed: int,
                            http_client: str = "lean") -> list[RequestRecord]:
    semaphore = asyncio.Semaphore(concurrency)
    if http_client == "lean":
        from perf.sse_client import SSEClient

        async with SSEClient(url) as lean:
            async def one_lean(i: int, prompt: str) -> RequestRecord:
                async with semaphore:
                    return await _lean_one(lean, model, prompt, workload, eos_ids, seed + i)

            return list(await asyncio.gather(*(one_lean(i, p) for i, p in items)))
    if http_client != "httpx":
        raise ValueError(f"http_client is one of {HTTP_CLIENTS}, not {http_client!r}")
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=3600) as client:
        async def one(i: int, prompt: str) -> RequestRecord:
            async with semaphore:
                return await _http_one(client, url, model, prompt, workload, eos_ids, seed + i)

        return list(await asyncio.gather(*(one(i, p) for i, p in items)))


def _http_shard(url: str, model: str, workload: Workload, items: list[tuple[int, str]], concurrency: int,
                eos_ids: list[int], seed: int, start_at: float,
                http_client: str = "lean") -> tuple[list[RequestRecord], float, float]:
    """One client process's share, started at the wall-clock `start_at` shared by every shard, on uvloop
    where it is installed: its records, when it finished (wall clock) and the CPU seconds it spent."""
    if http_client == "httpx":
        import httpx  # noqa: F401 - imported before the clock starts
    else:
        import msgspec  # noqa: F401

        import perf.sse_client  # noqa: F401
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    time.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        records = runner.run(_http_closed_loop(url, model, workload, items, concurrency, eos_ids, seed, http_client))
    return records, time.time(), time.process_time() - cpu


async def run_http(url: str, model: str, workload: Workload, concurrency: int, eos_ids: list[int],
                   seed: int = 0, procs: int = 1, http_client: str = "lean") -> dict[str, Any]:
    """A closed loop of `concurrency` streams. With `procs` > 1 the streams (and prompts) are split
    over that many client processes: one Python process parses ~5,000 SSE events per second with httpx
    (~180 µs of CPU per event on a 2-core x86 host), less than a GPU server sends at c=256, so a single
    client would measure itself. `http_client`: "lean" (perf/sse_client.py, the default: a fraction
    of httpx's CPU per event, `python -m perf.bench_sse_client`) or "httpx"."""
    if http_client not in HTTP_CLIENTS:
        raise ValueError(f"http_client is one of {HTTP_CLIENTS}, not {http_client!r}")
    items = list(enumerate(make_prompts(workload, seed)))
    procs = max(1, min(procs, concurrency))
    if procs == 1:
        cpu = time.process_time()
        start = time.perf_counter()
        records = await _http_closed_loop(url, model, workload, items, concurrency, eos_ids, seed, http_client)
        result = summarize(records, time.perf_counter() - start, workload, concurrency, url)
        result["client_cpu_s"] = time.process_time() - cpu
        result["http_client"] = http_client
        return result
    import concurrent.futures
    import multiprocessing

    shares = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.3] * procs))  # every worker started (one per busy submit)
        start_at = time.time() + 1.0
        shards = await asyncio.gather(*(
            loop.run_in_executor(pool, _http_shard, url, model, workload, items[k::procs], shares[k], eos_ids,
                                 seed, start_at, http_client) for k in range(procs)))
    records = [r for shard in shards for r in shard[0]]
    result = summarize(records, max(end for _, end, _ in shards) - start_at, workload, concurrency, url)
    result["client_procs"] = procs
    result["client_cpu_s"] = sum(cpu for _, _, cpu in shards)
    result["http_client"] = http_client
    return result


# ---------------------------------------------------------------------------- ZeroMQ

async def run_zmq(router: str, workload: Workload, concurrency: int, eos_ids: list[int],
                  seed: int = 0) -> dict[str, Any]:
    from parallm.client import AsyncClient
    from parallm.protocol import SamplingParams

    prompts = make_prompts(workload, seed)
    async with AsyncClient(router) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: str) -> RequestRecord:
            params = SamplingParams(max_tokens=workload.max_tokens, temperature=1.0 if workload.n > 1 else 0.0,
                                    seed=seed + i, logit_bias={t: -100.0 for t in eos_ids}, logprobs=True)
            record = RequestRecord(ok=False)
            async with semaphore:
                start = last = time.perf_counter()
                first = True
                try:
                    text = [{"role": "user", "content": prompt}] if workload.chat else prompt
                    async for out in client.stream(text, params, n=workload.n):
                        count = len(out.token_ids) // 4
                        if count:
                            now = time.perf_counter()
                            if first:
                                record.ttft, first = now - start, False
                            else:
                                record.itls.append(now - last)
                            last = now
                            record.tokens += count
                except Exception as exc:  # noqa: BLE001
                    record.error = f"{type(exc).__name__}: {exc}"
                    return record
                record.latency = time.perf_counter() - start
                record.ok = True
                return record

        start = time.perf_counter()
        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return summarize(list(records), wall, workload, concurrency, router)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="OpenAI-compatible server base URL (without /v1)")
    target.add_argument("--router", help="parallm router address for the raw ZeroMQ client")
    parser.add_argument("--model", default="default")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, help="override the workload's request count")
    parser.add_argument("--max-tokens", type=int, help="override the workload's output length")
    parser.add_argument("--eos-ids", default="2", help="token ids to suppress (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-procs", type=int, default=1, help="HTTP client processes sharing the streams")
    parser.add_argument("--http-client", choices=HTTP_CLIENTS, default="lean",
                        help="lean (perf/sse_client.py) or httpx")
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    if args.requests or args.max_tokens:
        workload = Workload(**{**asdict(workload), **({"requests": args.requests} if args.requests else {}),
                               **({"max_tokens": args.max_tokens} if args.max_tokens else {})})
    eos = [int(x) for x in args.eos_ids.split(",") if x]
    if args.url:
        result = asyncio.run(run_http(args.url, args.model, workload, args.concurrency, eos, args.seed,
                                      procs=args.client_procs, http_client=args.http_client))
    else:
        result = asyncio.run(run_zmq(args.router, workload, args.concurrency, eos, args.seed))
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
