"""One stream's decode time per token: in-process engine vs raw ZeroMQ client vs HTTP (issue 37, item 3).

With a tiny random-weight model the device's work per token is small, so what separates the served
figures from the in-process one is the pipeline's host-side cost: the engine stage's loop, the output
message, the detokenizer, ingress' SSE, the waits between stages. Each level runs one request at a
time of `--max-tokens` tokens (EOS never sampled, greedy, the same prompt ids everywhere):

- `inprocess`: the Engine in a fresh process, built from the same command-line settings as the server
  (so the backend's resolved defaults match), stepping one request to its end;
- `zmq`: `parallm.client.Client.stream` against `parallm-launch` (token ids in, token ids out);
- `http_stream`: a streamed `/v1/completions` read by a raw HTTP/1.1 socket client (no JSON parsing
  per event, so the client costs a few µs an event);
- `http`: the same request not streamed.

ms/token is (last token's arrival - first token's arrival) / (tokens - 1) for the in-process engine and
the HTTP stream (whose events may carry several tokens of a stream that fell behind: tokens_per_event), and (latency of `--max-tokens` tokens - latency of 1 token) / (tokens - 1) for the raw
client (whose thread hop can bunch a stream's arrivals) and non-streamed HTTP, the median over
`--requests` requests of each round. A 1-token request's latency, sent as soon as the previous request
ended, is what a single client pays per request beside its tokens. The served engine's own loop split (inbox, step,
send, beat per iteration: `EngineStats.loop`) is recorded with each served round.

`--source LABEL=DIR` (repeatable) measures another checkout too, alternating with this one round by
round (each round a fresh server per checkout, in-process first), for a before/after on one machine:
DIR is a checkout (e.g. `git worktree add --detach /tmp/base main`) whose `parallm/stages` and
`parallm/launch` resolve (the script links them, as perf.bench_ingress does).

    python -m perf.bench_single_stream --rounds 3 --source base=/tmp/base      # CPU, tiny-draft shape
    bash perf/gpu_runs.sh single      # the smollm2-135m and llama-3.2-3b shapes on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(count: int, vocab: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 30_000)) for _ in range(count)]


# ---------------------------------------------------------------------------- in-process (a child process)

def inprocess(server_args: list[str], ids: list[int], max_tokens: int, requests: int,
              ban: list[int] | None = None) -> dict[str, Any]:
    """The engine of `parallm-launch SERVER_ARGS`, in this process: ms/token of each request. On a CPU the
    process re-executes itself with OpenBLAS (and mimalloc) preloaded first, as the engine stage does."""
    import mlx.core as mx

    from parallm import blas

    if mx.default_device() == mx.cpu:  # as the supervisor does for the engine stage (launch/supervisor.py)
        blas.reexec_with_openblas()
    from parallm.config.loading import parse_args
    from parallm.engine import Engine, EngineModel, make_request
    from parallm.models import load_model

    config = parse_args(server_args)
    config = config[0] if isinstance(config, tuple) else config
    engine = Engine(EngineModel.of(load_model(config.model)), config)
    engine.warm_up()
    params = sampling(max_tokens, ban)
    per_token = []
    for i in range(requests + 1):  # the first is a warm-up
        engine.add_request(make_request(rid=f"r{i}", prompt_ids=ids, params=params))
        first = last = 0.0
        tokens = 0
        while engine.has_work():
            for out in engine.step():
                if out.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    tokens += len(out.token_ids)
        if i:
            per_token.append(1000 * (last - first) / max(1, tokens - 1))
    engine.close()
    return {"ms_per_token": per_token}


def sampling(max_tokens: int, ban: list[int] | None) -> Any:
    """Greedy SamplingParams that never stop before `max_tokens`: `ignore_eos`, or with `ban` the EOS ids
    banned by logit_bias (perf/bench_serving.py's and mlx_lm.server's way; a different sampler path)."""
    from parallm.protocol import SamplingParams

    if ban:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias={t: -100.0 for t in ban})
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def eos_ids(model_dir: Path) -> list[int]:
    """The EOS ids of a model directory's config.json."""
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id", [])
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]


# ---------------------------------------------------------------------------- clients

def http_request(port: int, body: dict[str, Any]) -> tuple[list[float], float, bytes]:
    """One request on a fresh connection: the arrival time of each received `data:` event carrying
    tokens (streamed), the latency, and the body."""
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        data = bytearray()
        events: list[float] = []
        while chunk := sock.recv(1 << 16):
            now = time.perf_counter()
            events += [now] * chunk.count(b'"text":"')  # a content event (usage and [DONE] carry no text)
            data += chunk
    latency = time.perf_counter() - start
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"request failed: {bytes(data[:400])!r}")
    return events, latency, bytes(data)


def http_levels(port: int, ids: list[int], max_tokens: int, requests: int,
                ban: list[int] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
    body.update({"logit_bias": {str(t): -100 for t in ban}} if ban else {"ignore_eos": True})
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    http_request(port, stream)  # warm-up
    streamed, per_event = [], []
    for _ in range(requests):
        events, _, data = http_request(port, stream)
        tokens = int(re.findall(rb'"completion_tokens":(\d+)', data)[-1])  # an event may carry several (coalesced)
        streamed.append(1000 * (events[-1] - events[0]) / max(1, tokens - 1))
        per_event.append(tokens / len(events))
    one, full = [], []
    for _ in range(requests):
        one.append(http_request(port, {**body, "max_tokens": 1})[1])
        full.append(http_request(port, body)[1])
    whole = [1000 * (f - o) / (max_tokens - 1) for f, o in zip(sorted(full), sorted(one))]
    return {"http_stream": {"ms_per_token": streamed, "tokens_per_event": per_event},
            "http": {"ms_per_token": whole, "latency_1_ms": [1000 * x for x in one],
                     "latency_n_ms": [1000 * x for x in full]}}


def zmq_level(router: str, ids: list[int], max_tokens: int, requests: int,
              ban: list[int] | None = None) -> dict[str, Any]:
    """The raw client: each request's latency (submit to its last output) at `max_tokens` and at 1 token,
    and the arrival spacing of the streamed outputs (which the client's thread hop can bunch)."""
    from parallm.client import Client

    def one(client: Client, tokens: int) -> tuple[float, list[float]]:
        params = sampling(tokens, ban)
        start = time.perf_counter()
        arrivals: list[float] = []
        for out in client.stream(ids, params):
            count = len(out.token_ids) // 4 if isinstance(out.token_ids, bytes) else len(out.token_ids)
            arrivals += [time.perf_counter()] * count
        return arrivals[-1] - start, arrivals

    spacing, one_s, full_s = [], [], []
    with Client(router, timeout=600) as client:
        one(client, max_tokens)  # warm-up
        for _ in range(requests):
            one_s.append(one(client, 1)[0])
            latency, arrivals = one(client, max_tokens)
            full_s.append(latency)
            spacing.append(1000 * (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1))
    whole = [1000 * (f - o) / (max_tokens - 1) for f, o in zip(sorted(full_s), sorted(one_s))]
    return {"zmq": {"ms_per_token": whole, "arrival_spacing_ms": spacing, "latency_1_ms": [1000 * x for x in one_s],
                    "latency_n_ms": [1000 * x for x in full_s]}}


# ---------------------------------------------------------------------------- one source, one round

def engine_split(before: Any, after: Any) -> dict[str, Any]:
    """The served engine's loop split per working iteration (ms) and its phases per step between two
    stats reads."""
    steps = after.loop.steps - before.loop.steps
    loop = {k: round((after.loop.ms_mean.get(k, 0) * after.loop.steps - before.loop.ms_mean.get(k, 0)
                      * before.loop.steps) / max(1, steps), 4) for k in after.loop.ms_mean}
    return {"loop_ms": loop, "iterations": steps}


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def run_round(label: str, root: str | None, model_dir: Path, args: argparse.Namespace, ids: list[int]) -> dict[str, Any]:
    from perf.harness import Server, cpu_delta

    server_args = ["--model.path", str(model_dir), "--model.served-name", "bench", *args.server_args.split()]
    row: dict[str, Any] = {"source": label, "load_before": load_average()}
    env = dict(os.environ)
    code_root = root or str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([code_root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--inner-inprocess",
                            json.dumps({"server_args": server_args, "ids": ids, "max_tokens": args.max_tokens,
                                        "requests": args.requests, "ban": args.ban})],
                           cwd=code_root, env=env, capture_output=True, text=True, timeout=1800)
    if child.returncode:
        raise RuntimeError(f"in-process run failed:\n{child.stderr[-3000:]}")
    row["inprocess"] = json.loads(child.stdout.strip().splitlines()[-1])
    server = Server(*server_args, env=dict(os.environ), ready_timeout=600)
    if root is not None:  # that checkout's code for every stage
        server.env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in server.env.get("PYTHONPATH", "").split(
            os.pathsep) if p and p != str(ROOT))])  # (a GPU machine's MLX comes on PYTHONPATH)
        server.argv = ["env", "-C", root, sys.executable, "-m", "parallm.launch", *server.argv[1:]]
    server.start()
    try:
        before, cpu0 = server.engine_stats(), server.cpu_seconds()
        row.update(zmq_level(server.router, ids, args.max_tokens, args.requests, args.ban))
        between, cpu1 = server.engine_stats(), server.cpu_seconds()
        row.update(http_levels(server.port, ids, args.max_tokens, args.requests, args.ban))
        after, cpu2 = server.engine_stats(), server.cpu_seconds()
        row["zmq"]["engine"] = engine_split(before, between)
        row["http_stream"]["engine"] = engine_split(between, after)  # with the non-streamed requests
        # CPU ms of each stage per generated token (load-proof, unlike the wall times)
        zmq_tokens = (args.requests + 1) * args.max_tokens + args.requests
        http_tokens = (args.requests + 1) * args.max_tokens + args.requests * (args.max_tokens + 1)
        row["zmq"]["stage_cpu_ms_per_token"] = {k: round(1000 * v / zmq_tokens, 4)
                                                for k, v in cpu_delta(cpu0, cpu1).items()}
        row["http"]["stage_cpu_ms_per_token"] = {k: round(1000 * v / http_tokens, 4)
                                                 for k, v in cpu_delta(cpu1, cpu2).items()}
    finally:
        server.stop()
    row["load_after"] = load_average()
    for level in ("inprocess", "zmq", "http_stream", "http"):
        row[level]["median"] = round(statistics.median(row[level]["ms_per_token"]), 3)
    row["http"]["latency_1_median_ms"] = round(statistics.median(row["http"]["latency_1_ms"]), 2)
    return row


def summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"# One stream's decode: ms per token ({args.shape}, {args.max_tokens} tokens, "
             f"{'EOS banned by logit_bias, ' if args.ban_eos else ''}"
             f"{args.requests} requests per level and round)", "",
             "| round | source | in-process | raw ZeroMQ | HTTP streamed | HTTP | 1-token HTTP request, ms | "
             "served engine's loop under ZeroMQ: inbox / step / send / beat ms | stage CPU ms per token over HTTP: "
             "engine / detokenizer / ingress | load before / after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        loop = row["zmq"]["engine"]["loop_ms"]
        split = " / ".join(f"{loop.get(k, 0):.3f}" for k in ("inbox", "step", "send", "beat"))
        cpu = row["http"].get("stage_cpu_ms_per_token", {})
        cpus = " / ".join(f"{cpu.get(k, 0):.3f}" for k in ("engine", "detokenizer", "ingress"))
        lines.append(f"| {row['round']} | {row['source']} | {row['inprocess']['median']:.3f} | "
                     f"{row['zmq']['median']:.3f} | {row['http_stream']['median']:.3f} | {row['http']['median']:.3f} "
                     f"| {row['http']['latency_1_median_ms']:.1f} | {split} | {cpus} | "
                     f"{row['load_before']} / {row['load_after']} |")
    lines += ["", "ms per token: (last token's arrival - first's) / (tokens - 1) for in-process and HTTP streamed; "
              "(latency of the full request - latency of a 1-token request) / (tokens - 1) for raw ZeroMQ and HTTP "
              "not streamed; medians over the round's requests. The 1-token request's latency is one request sent "
              "as soon as the previous one ended (what a single client's next request waits for). Wall times "
              "measured with a load average above 6 are noise on this 2-core machine; the stage CPU times are not."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from perf.harness import Results, add_results_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny-draft", help="a parallm.models.shapes shape (random weights, the "
                        "default model's tokenizer and vocabulary unless --tokenizer-dir)")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--tokenizer-dir", default="")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=5, help="measured requests per level and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--source", action="append", default=[], help="LABEL=DIR: another checkout, alternated")
    parser.add_argument("--label", default="this")
    parser.add_argument("--server-args", default="", help="extra parallm-launch arguments (both sources)")
    parser.add_argument("--ban-eos", action="store_true", help="requests ban the model's EOS ids by logit_bias "
                        "(as perf/bench_serving.py's do) instead of ignore_eos")
    add_results_options(parser)
    args = parser.parse_args(argv)

    from perf.bench_ingress import checkouts
    from perf.bench_serving import shape_model_dir

    model_dir = shape_model_dir(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = prompt_ids(args.prompt_len, vocab)
    args.ban = eos_ids(model_dir) if args.ban_eos else None
    results = Results.from_args("single-stream", args, argv)
    sources = checkouts(parser, args)
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for label, root in (sources if r % 2 == 0 else sources[::-1]):
            row = {"round": r, **run_round(label, root, model_dir, args, ids)}
            print(json.dumps({k: (v["median"] if isinstance(v, dict) and "median" in v else v)
                              for k, v in row.items()}), flush=True)
            rows.append(row)
            results.write({"shape": args.shape, "max_tokens": args.max_tokens, "rows": rows}, summary(rows, args))
    print(summary(rows, args))
    print(f"wrote {results.json}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--inner-inprocess":
        spec = json.loads(sys.argv[2])
        print(json.dumps(inprocess(spec["server_args"], spec["ids"], spec["max_tokens"], spec["requests"],
                                   spec.get("ban"))))
        raise SystemExit(0)
    raise SystemExit(main())
