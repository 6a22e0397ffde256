"""Served throughput and latency against the in-process engine, on the same model in one run.

For each concurrency level it runs the same fixed-seed workload (chat prompts, end-of-sequence
suppressed so every request runs `max_tokens`) three or four ways, one after another:

- `inprocess`: parallm's Engine driven directly (no sockets), closed loop with `c` requests open;
- `batchgen`: mlx-lm's BatchGenerator (the engine mlx_lm.server runs; its default batch sizes) on
  the same model object, prompts and closed loop, new prompts inserted as soon as others finish;
- `http`: `parallm-launch` over OpenAI streaming HTTP (perf.loadgen);
- `zmq`: the same server over the raw ZeroMQ client;
- `mlx_lm.server` (with --mlx-lm-server): mlx-lm's own server on the same float32 weights, with
  the same OpenBLAS preload as parallm's engine (and, with --mlx-lm-allocator, parallm's allocator
  too: mimalloc, which parallm's supervisor preloads for its engine);
- `mlx_lm.server-shipped` (with --mlx-lm-shipped): mlx_lm.server as a user would run it on this
  model: its stored 4-bit weights (Q4_1 read as MLX 4-bit, group 32), MLX's own BLAS, no preloads.

This process preloads OpenBLAS and mimalloc like parallm's engine (the in-process targets run
here); `parallm-launch` is started without them, so its supervisor chooses what each of its
processes gets, as it does for a user.

    python -m perf.bench_serving --concurrency 1,16,32 --mlx-lm-server   # -> perf/results/serving-cpu.*

With `--shape` (a perf.bench_gpu shape, e.g. llama-3.2-3b on a GPU) every target serves a
random-weight model of that shape whose vocabulary is the default model's tokenizer, so each sampled
id decodes to real text and the detokenizer and SSE path do their real work:

    python -m perf.bench_serving --shape llama-3.2-3b --concurrency 1,64,256 --max-tokens 128 --mlx-lm-server

Every run has prompts of its own, so none is served from a prefix (or prompt) cache warmed by an
earlier one: each level's prompts are seeded by the level, shared by the in-process engine, HTTP
and mlx_lm.server (separate engines and servers), and the raw ZeroMQ client, which shares parallm's
server with HTTP, gets a seed of its own. (Before, every level reused the same first prompts and
the ZeroMQ run repeated the HTTP run's prompts on a warm cache: its TTFT read 0.99 s against a
cold 1.69 s on the same server.)

Issue 19's GPU runs, one 10-minute call each: `bash perf/gpu_runs.sh moe` (the Qwen3-30B-A3B-shaped
4-bit MoE at c=1,64,256, BatchGenerator vs HTTP), `bash perf/gpu_runs.sh moe256` (c=256 only, then
HTTP again with MLX_CUDA_USE_CUDNN_SDPA=0) and `bash perf/gpu_runs.sh hybrid` (the Qwen3.5-4B-like
hybrid, the same way).

After each served run, and each in-process one, the engine's own figures are kept with it (perf/engine_figures.py: its
steps by kind, step-time percentiles, prefill tokens per pass, preemptions and recomputed tokens,
OOM retries, KV budget and live buffer, row operations, first-seen pass shapes and the slowest
steps with their phases), so a slow run says where its time went, step by step beside the other target.

With `--repeats N` each level runs N times on the same warm in-process engine and on the same warm server
(new prompts each run), and the ratios are of each target's median: a single run of a served c=256 on the
H200 moved 14,428-19,649 tok/s from one fresh server to the next (issue 37). With `--paired` the server and
the in-process engine are up together and alternate run by run (c in process, then c served): within one call
the in-process engine's c=256 moved from 20,558-23,856 to 16,239-18,376 tok/s, so runs minutes apart compare
the host's drift as much as the targets.

Writes perf/results/serving[-EXPERIMENT]-DEVICE.json (every number, the machine and the command),
a markdown table (.md) and plots (.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from perf import engine_figures
from perf.harness import Process, Results, Server, add_results_options, cpu_delta, describe, free_port
from perf.loadgen import HTTP_CLIENTS, WORKLOADS, RequestRecord, Workload, make_prompts, run_http, run_zmq, summarize


# ---------------------------------------------------------------------------- in-process

def chat_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def prompt_seed(concurrency: int, target: str, repeat: int = 0) -> int:
    """The prompt seed of one run (see the module docstring); a repeat's prompts are new ones too."""
    return 10 * concurrency + (1 if target == "zmq" else 0) + 100_000 * repeat


WARM_SEED = 99_999


def run_inprocess(engine: Any, prompt_ids: list[list[int]], workload: Workload, concurrency: int,
                  eos_ids: list[int], seed: int = 0) -> dict[str, Any]:
    """Closed loop: `concurrency` requests open at a time, a new one as soon as one finishes."""
    from parallm.engine import make_request
    from parallm.protocol import SamplingParams

    pending = deque(enumerate(prompt_ids))
    open_: dict[str, tuple[RequestRecord, list[float]]] = {}
    records: list[RequestRecord] = []
    def handle(outputs: list) -> None:
        now = time.perf_counter()
        for out in outputs:
            record, clock = open_[out.rid]
            if out.token_ids:
                if clock[2]:
                    record.ttft, clock[2] = now - clock[0], 0.0
                else:
                    record.itls.append(now - clock[1])
                clock[1] = now
                record.tokens += len(out.token_ids)
            if out.finish_reason is not None:
                record.ok = out.finish_reason in ("length", "stop")
                record.latency = now - clock[0]
                records.append(record)
                del open_[out.rid]

    start = time.perf_counter()
    while pending or open_:
        while pending and len(open_) < concurrency:
            i, ids = pending.popleft()
            params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, seed=seed + i,
                                    logit_bias={t: -100.0 for t in eos_ids})
            rid = f"bench-{i}"
            engine.add_request(make_request(rid=rid, prompt_ids=ids, params=params, n=workload.n))
            now = time.perf_counter()
            open_[rid] = (RequestRecord(ok=False), [now, now, 1.0])  # start, last, first-pending
        handle(engine.step(emit=handle))  # first tokens as the prefill pass hands them out, then the rest
    wall = time.perf_counter() - start
    return summarize(records, wall, workload, concurrency, "inprocess")


def run_batchgen(model: Any, prompt_ids: list[list[int]], workload: Workload, concurrency: int) -> dict[str, Any]:
    """mlx-lm's BatchGenerator in the same closed loop as `run_inprocess`: greedy, no stop tokens
    (so every request runs `max_tokens`, as EOS suppression does for the others), mlx_lm.server's
    default batch sizes (32 decoding, 8 prompts per prefill)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=workload.max_tokens, stop_tokens=None,
                         completion_batch_size=max(32, concurrency), prefill_batch_size=8)
    pending = deque(prompt_ids)
    open_: dict[int, tuple[RequestRecord, list[float]]] = {}
    records: list[RequestRecord] = []
    try:
        start = time.perf_counter()
        while pending or open_:
            room = concurrency - len(open_)
            if pending and room > 0:
                batch = [pending.popleft() for _ in range(min(room, len(pending)))]
                uids = gen.insert(batch, max_tokens=[workload.max_tokens] * len(batch))
                now = time.perf_counter()
                for uid in uids:
                    open_[uid] = (RequestRecord(ok=False), [now, now, 1.0])
            responses = gen.next_generated()
            now = time.perf_counter()
            for r in responses:
                record, clock = open_[r.uid]
                if clock[2]:
                    record.ttft, clock[2] = now - clock[0], 0.0
                else:
                    record.itls.append(now - clock[1])
                clock[1] = now
                record.tokens += 1
                if r.finish_reason is not None:
                    record.ok = r.finish_reason == "length"
                    record.latency = now - clock[0]
                    records.append(record)
                    del open_[r.uid]
        wall = time.perf_counter() - start
    finally:
        gen.close()
        del gen
        mx.clear_cache()
    return summarize(records, wall, workload, concurrency, "batchgen")


# ---------------------------------------------------------------------------- servers

def wait_http(url: str, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


# ---------------------------------------------------------------------------- report

def write_report(result: dict[str, Any], results: Results) -> None:
    rows = ["| target | c | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | ok |",
            "|---|---|---|---|---|---|---|---|"]
    def label(r: dict[str, Any]) -> str:
        return r["target"] + (f" #{r['repeat'] + 1}" if r.get("repeat") else "")

    for r in result["runs"]:
        rows.append(f"| {label(r)} | {r['concurrency']} | {r['throughput_tok_s']:.1f} | {r['ttft_p50_s']:.3f} | "
                    f"{r['ttft_p99_s']:.3f} | {1000 * r['itl_p50_s']:.1f} | {1000 * r['itl_p99_s']:.1f} | "
                    f"{r['ok']}/{r['requests']} |")
    names = {"http": "http/inprocess", "zmq": "zmq/inprocess", "vs_batchgen": "http/batchgen",
             "vs_mlx_lm": "http/mlx_lm.server", "vs_mlx_lm_shipped": "http/mlx_lm.server-shipped"}
    ratios = [f"- c={c}: " + ", ".join(f"{names[k]} = {v[k]:.2f}" for k in names if k in v)
              for c, v in result["ratios"].items() if v]
    cpu = [f"- {label(r)} c={r['concurrency']}: client {r.get('client_cpu_s', 0):.1f} s, "
           + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(r["server_cpu_s"].items()))
           + f" (wall {r['wall_s']:.1f} s)" for r in result["runs"] if r.get("server_cpu_s")]
    engine = [line for r in result["runs"] if r.get("engine")
              for line in engine_figures.lines(f"{label(r)} c={r['concurrency']}", r["engine"])]
    md = [f"# Served vs in-process ({result['workload']}, {result['max_tokens']} output tokens)", "",
          f"Machine: {describe(results.machine)}", "", f"Command: `{results.command}`", "",
          *([f"parallm's weights (in process and served): stored {w['stored']}, served {w['served']} ({w['reason']})", ""]
            if (w := result.get("weight_dtype")) else []), *rows, "", "Ratios" + (" (of each target's median over its runs):" if len(result["runs"]) > len(
              {(r["target"], r["concurrency"]) for r in result["runs"]}) else ":"),
          *ratios, *(["", "CPU seconds per process during each served run:", *cpu] if cpu else []),
          *(["", "The engine's own figures during each run (perf/engine_figures.py; the slowest steps "
             "with their phases in ms):", *engine] if engine else [])]
    results.write(result, "\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for target in sorted({r["target"] for r in result["runs"]}):
        runs = sorted((r for r in result["runs"] if r["target"] == target), key=lambda r: r["concurrency"])
        cs = [r["concurrency"] for r in runs]
        ax1.plot(cs, [r["throughput_tok_s"] for r in runs], marker="o", label=target)
        ax2.plot(cs, [r["ttft_p50_s"] for r in runs], marker="o", label=target)
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax2.set(xlabel="concurrency", ylabel="TTFT p50 (s)", title="time to first token")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(results.png, dpi=100)


# ---------------------------------------------------------------------------- main

def client_procs(args: argparse.Namespace, concurrency: int) -> int:
    return args.client_procs if concurrency >= 16 else 1


def shape_model_dir(args: argparse.Namespace) -> Path:
    """--shape's model directory: random weights, the default model's tokenizer and vocabulary size."""
    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer, materialize
    from perf.bench_gpu import build_model_dir

    if args.tokenizer_dir:  # e.g. on a GPU machine, where the default model's package is not installed
        from transformers import AutoTokenizer

        tokenizer_dir = Path(args.tokenizer_dir)
        vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))
    else:
        default = load_model(ModelConfig())
        tokenizer_dir = materialize(default.source, "float32")
        vocab = len(load_tokenizer(default.source))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir()) / "parallm-bench-shapes"
    return build_model_dir(args.shape, work / f"{args.shape}-v{vocab}", tokenizer_dir, vocab_size=vocab)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,16,32")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests per concurrency slot (at least 8 in all)")
    parser.add_argument("--max-requests", type=int, default=0,
                        help="at most this many requests a level (0: no cap), e.g. 256 with 2 per slot: 128 at c=64, "
                             "256 at c=256")
    parser.add_argument("--quantized-weights", choices=("auto", "keep", "dequantize"), default="auto",
                        help="model.quantized_weights for every target (the in-process model, BatchGenerator's, "
                             "and parallm-launch's); mlx_lm.server always gets the stored weights with --shape")
    parser.add_argument("--targets", default="inprocess,batchgen,http,zmq")
    parser.add_argument("--mlx-lm-server", action="store_true", help="also run mlx_lm.server on the same weights")
    parser.add_argument("--mlx-lm-shipped", action="store_true",
                        help="also run mlx_lm.server as shipped: the stored 4-bit weights, no preloads")
    parser.add_argument("--mlx-lm-allocator", action="store_true",
                        help="preload parallm's allocator (mimalloc) for mlx_lm.server too")
    parser.add_argument("--server-args", default="", help="extra parallm-launch arguments")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each level by the in-process engine and the server, each on the same warm "
                             "engine or server with prompts of its own; ratios are of the medians")
    parser.add_argument("--paired", action="store_true",
                        help="run the in-process engine and the server side by side, alternating run by run (each "
                             "level in process, then served): the host's drift within a call falls on both alike. "
                             "Both hold their memory at once, so give them --kv-budget-mb and --buffer-cache-mb")
    parser.add_argument("--kv-budget-mb", type=float, default=None, help="engine.kv_budget_mb for every parallm target")
    parser.add_argument("--buffer-cache-mb", type=float, default=None,
                        help="engine.buffer_cache_mb for every parallm target")
    parser.add_argument("--warm-decode-rows", type=int, default=None,
                        help="engine.warm_decode_rows for every parallm target (the warm-up's decode-row ramp); "
                             "unset: the device's default")
    parser.add_argument("--client-procs", type=int, default=1,
                        help="HTTP client processes at concurrencies of 16 and more (one Python client parses "
                             "~5,000 events/s with httpx)")
    parser.add_argument("--http-client", choices=HTTP_CLIENTS, default="lean",
                        help="the HTTP targets' client: lean (perf/sse_client.py, ~9x less CPU per event than httpx: "
                             "perf/results/sse-client-cpu.md) or httpx (the client of the runs before the twentieth "
                             "session)")
    parser.add_argument("--shape", help="a perf.bench_gpu shape with random weights and the default model's "
                                        "tokenizer, instead of the default model")
    parser.add_argument("--work-dir", default="", help="where --shape's model is built (reused if there)")
    parser.add_argument("--tokenizer-dir", default="",
                        help="tokenizer files for --shape; default: the converted default model's")
    add_results_options(parser)
    args = parser.parse_args(argv)

    from parallm import blas

    blas.reexec_with_openblas()
    # a call's `timeout` (perf/gpu_runs.sh) ends the run with SIGTERM: exit through the finally blocks, so the
    # servers started below (each in a session of its own) are stopped rather than left holding the GPU
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from parallm.config import Config, EngineConfig, ModelConfig
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model, load_tokenizer, materialize

    levels = [int(c) for c in args.concurrency.split(",")]
    targets = args.targets.split(",") + (["mlx_lm.server"] if args.mlx_lm_server else [])
    if args.paired and not ("inprocess" in targets and {"http", "zmq"} & set(targets)):
        parser.error("--paired alternates the in-process engine with a server: --targets needs inprocess and http or zmq")
    eos = [2]
    weights = None if args.quantized_weights == "auto" else args.quantized_weights
    model_config = ModelConfig(quantized_weights=weights)
    if args.shape:
        model_config = ModelConfig(path=str(shape_model_dir(args)), quantized_weights=weights)
    loaded = load_model(model_config)
    choice = loaded.dtype_choice
    weight_dtype = {"stored": choice.stored, "served": choice.served, "reason": choice.reason}
    print(f"weights: {weight_dtype}", flush=True)
    tokenizer = load_tokenizer(loaded.source)
    max_seqs = max(levels)
    runs: list[dict[str, Any]] = []
    results = Results.from_args("serving", args, argv)

    def keep(run: dict[str, Any]) -> None:
        """Record a finished run and write what is done so far: a call cut short keeps its rows."""
        runs.append(run)
        print(json.dumps(run), flush=True)
        results.write({"workload": args.workload, "max_tokens": args.max_tokens, "weight_dtype": weight_dtype,
                       "runs": runs, "partial": True})

    def workload_for(c: int) -> Workload:
        base = WORKLOADS[args.workload]
        requests = max(8, c * args.requests_per_client)
        return Workload(**{**base.__dict__, "max_tokens": args.max_tokens,
                           "requests": min(requests, args.max_requests) if args.max_requests else requests})

    engine_config = EngineConfig(max_num_seqs=max_seqs, kv_budget_mb=args.kv_budget_mb, buffer_cache_mb=args.buffer_cache_mb,
                                 warm_decode_rows=args.warm_decode_rows)
    memory_args = [arg for flag, value in (("--engine.kv-budget-mb", args.kv_budget_mb),
                                           ("--engine.buffer-cache-mb", args.buffer_cache_mb),
                                           ("--engine.warm-decode-rows", args.warm_decode_rows))
                   if value is not None for arg in (flag, str(value))]

    def start_engine() -> Any:
        """The in-process engine, warmed up as the engine stage warms its own (Engine.warm_up), then two requests."""
        engine = Engine(EngineModel.of(loaded), Config(model=model_config, engine=engine_config))
        engine.warm_up()
        warm = workload_for(1)
        run_inprocess(engine, chat_ids(tokenizer, make_prompts(warm, WARM_SEED))[:2], warm, 2, eos)
        return engine

    def inprocess_run(engine: Any, c: int, repeat: int) -> None:
        w = workload_for(c)
        prompt_ids = chat_ids(tokenizer, make_prompts(w, prompt_seed(c, "inprocess", repeat)))
        engine_figures.settle()  # the run's burst of engine steps is its own, as for the served runs
        stats_before = msgspec.to_builtins(engine.stats())
        r = run_inprocess(engine, prompt_ids, w, c, eos)
        r["settings"] = {k: getattr(engine.config, k) for k in engine_figures.SETTINGS}  # as resolved here
        engine_figures.settle()
        r["engine"] = engine_figures.figures(stats_before, msgspec.to_builtins(engine.stats()))
        r["repeat"] = repeat
        keep(r)

    def start_server() -> Server:
        server = Server("--model.path", model_config.path, "--engine.max-num-seqs", str(max_seqs),
                        "--model.served-name", "bench",
                        *(["--model.quantized-weights", weights] if weights else []), *memory_args,
                        *args.server_args.split(), ready_timeout=600).start()
        try:
            asyncio.run(run_http(server.url, "bench", workload_for(1), 2, eos, WARM_SEED))  # warm-up
        except BaseException:
            server.stop()
            raise
        return server

    def served_run(server: Server, target: str, c: int, repeat: int) -> None:
        w = workload_for(c)
        engine_figures.settle()  # the run's burst of engine steps is its own
        stats_before = engine_figures.snapshot(server.router)
        before = server.cpu_seconds()
        if target == "http":
            r = asyncio.run(run_http(server.url, "bench", w, c, eos, prompt_seed(c, "http", repeat),
                                     procs=client_procs(args, c), http_client=args.http_client))
        else:
            r = asyncio.run(run_zmq(server.router, w, c, eos, prompt_seed(c, "zmq", repeat)))
        r["target"] = target
        r["server_cpu_s"] = cpu_delta(before, server.cpu_seconds())
        engine_figures.settle()
        r["engine"] = engine_figures.figures(stats_before, engine_figures.snapshot(server.router))
        r["repeat"] = repeat
        keep(r)

    served = [t for t in ("http", "zmq") if t in targets]
    if args.paired:  # the server first (its engine sizes its memory by what is free), then the in-process engine
        server = start_server()
        try:
            engine = start_engine()
            for repeat in range(args.repeats):
                for c in levels:
                    inprocess_run(engine, c, repeat)
                    for target in served:
                        served_run(server, target, c, repeat)
            del engine
        finally:
            server.stop()
        targets = [t for t in targets if t not in ("inprocess", *served)]

    if "inprocess" in targets:
        engine = start_engine()
        for repeat in range(args.repeats):
            for c in levels:
                inprocess_run(engine, c, repeat)
        del engine

    if "batchgen" in targets:
        warm = workload_for(1)
        run_batchgen(loaded.model, chat_ids(tokenizer, make_prompts(warm, WARM_SEED))[:2], warm, 2)
        for c in levels:
            w = workload_for(c)
            prompt_ids = chat_ids(tokenizer, make_prompts(w, prompt_seed(c, "inprocess")))
            keep(run_batchgen(loaded.model, prompt_ids, w, c))

    if "http" in targets or "zmq" in targets:
        server = start_server()
        try:
            for repeat in range(args.repeats):
                for c in levels:
                    for target in served:
                        served_run(server, target, c, repeat)
        finally:
            server.stop()

    baselines = []
    if "mlx_lm.server" in targets:  # the same float32 weights and OpenBLAS as parallm's engine
        baselines.append(("mlx_lm.server", "float32",
                          blas.openblas_env(allocator=args.mlx_lm_allocator) or dict(os.environ)))
    if args.mlx_lm_shipped:  # the stored 4-bit weights, MLX's own BLAS and glibc's malloc
        baselines.append(("mlx_lm.server-shipped", "quantized", blas.without_preloads(dict(os.environ))))
    for label, dtype, env in baselines:
        path = loaded.source.path if args.shape else materialize(loaded.source, dtype)
        port = free_port()
        server = Process([sys.executable, "-m", "mlx_lm", "server", "--model", str(path), "--port", str(port),
                          "--host", "127.0.0.1"], ready="Starting httpd", env=env, ready_timeout=600).start()
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/v1/models")
            asyncio.run(run_http(url, str(path), workload_for(1), 2, eos, WARM_SEED))
            for c in levels:
                r = asyncio.run(run_http(url, str(path), workload_for(c), c, eos, prompt_seed(c, "mlx_lm.server"),
                                         procs=client_procs(args, c), http_client=args.http_client))
                r["target"] = label
                keep(r)
        finally:
            server.stop()

    ratios: dict[str, dict[str, float]] = {}
    tallies: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        tallies.setdefault((r["target"], r["concurrency"]), []).append(r["throughput_tok_s"])
    by = {key: statistics.median(values) for key, values in tallies.items()}  # one run each: that run
    for c in levels:
        base = by.get(("inprocess", c))
        entry = {}
        for t in ("http", "zmq"):
            if base and (t, c) in by:
                entry[t] = by[(t, c)] / base
        for key, baseline in (("vs_mlx_lm", "mlx_lm.server"), ("vs_mlx_lm_shipped", "mlx_lm.server-shipped"),
                              ("vs_batchgen", "batchgen")):
            if (baseline, c) in by and ("http", c) in by:
                entry[key] = by[("http", c)] / by[(baseline, c)]
        ratios[str(c)] = entry
    result = {"workload": args.workload, "max_tokens": args.max_tokens, "weight_dtype": weight_dtype,
              "mlx_lm_server_allocator": "mimalloc" if args.mlx_lm_allocator else "system",
              "runs": runs, "ratios": ratios}
    write_report(result, results)
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
