"""Adapter benchmark: publish -> first token under the new version, and mixed-batch throughput.

    PYTHONPATH=$PWD python -m perf.bench_adapters [--rows 16] [--tokens 48] [--publishes 30]
    python -m perf.bench_adapters --shape smollm2-135m --tokenizer-dir DIR --served   # on a GPU

In-process engine on the default model (float32 on CPU), rank-16 LoRA on q_proj and v_proj of
all layers (what the issue's goal names). With `--shape`, a random-weight model of that shape
(perf.bench_gpu; the GPU machine has no model files) in its stored dtype instead. Writes
perf/results/adapters[-EXPERIMENT]-DEVICE.{json,md} (adapters-cpu, adapters-h100).

- publish latency: safetensors bytes of a new version in hand -> `load_adapter` (parse, validate,
  cast, merge) -> the first token sampled under that version, (a) by a new request arriving with
  the publish on an otherwise idle engine (its prefill included), (b) by 8 running streams moved
  over by Pause(keep)/Resume (`follow_latest`); each with the version's merged weights
  (`_merged`, the GPU default) and without (`_factored`: `adapters.merge_mb` 0, the CPU
  default). The engine stage adds one ZeroMQ ipc hop and a msgpack decode on top; `--served`
  measures through parallm-launch with 8 base-model
  streams running (the new request's pass mixes base and adapter rows) and with none.
- throughput: decode tokens/s of `rows` greedy rows: base model only (no layer wrapped), base
  rows with adapters loaded (wrapped layers, none used, the device's default merging), all rows
  one adapter (merged, and factored), and rows spread over 4 adapters + base (the gather_mm path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import msgspec

from parallm.adapters import save_bytes
from parallm.config import AdaptersConfig, Config, EngineConfig, ModelConfig
from parallm.engine import Engine, EngineModel, make_request
from parallm.models import load_model
from parallm.protocol import SamplingParams
from perf.harness import Results, add_results_options, describe


def lora_blob(model, rank: int, seed: int,
              targets: tuple[str, ...] = ("self_attn.q_proj", "self_attn.v_proj")) -> tuple[dict, bytes]:
    """A random rank-`rank` LoRA on the layers whose path ends with one of `targets`."""
    mx.random.seed(seed)
    w = {}
    for path, module in model.named_modules():
        if path.endswith(targets):
            lin = getattr(module, "linear", module)
            o, i = lin.weight.shape
            w[f"{path}.lora_a"] = mx.random.normal((i, rank)) * (1 / i ** 0.5)
            w[f"{path}.lora_b"] = mx.random.normal((rank, o)) * 0.02
    config = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": {"rank": rank, "scale": 2.0, "dropout": 0.0}}
    return config, save_bytes(w)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def throughput(engine: Engine, adapters: list[str], rows: int, tokens: int, tag: str) -> float:
    prompts = [[1, 504 + i, 3458, 282, 2 + i] for i in range(rows)]
    for i, p in enumerate(prompts):  # warm-up with the same mix
        engine.add_request(make_request(rid=f"w{tag}{i}", prompt_ids=p, params=greedy(4), adapter=adapters[i % len(adapters)]))
    drain(engine)
    for i, p in enumerate(prompts):
        engine.add_request(make_request(rid=f"{tag}{i}", prompt_ids=p, params=greedy(tokens),
                                   adapter=adapters[i % len(adapters)]))
    while engine.stats().running < rows:  # prefill everything first: time decode only
        engine.step()
    g0, t0 = engine.stats().generated_tokens, time.perf_counter()
    drain(engine)
    return (engine.stats().generated_tokens - g0) / (time.perf_counter() - t0)


def publish_latency(engine: Engine, model, publishes: int, follow: bool) -> list[float]:
    blobs = [lora_blob(model, 16, 1000 + k) for k in range(publishes + 1)]
    engine.load_adapter("pol", config=blobs[0][0], weights=blobs[0][1])
    lat = []
    if follow:
        for i in range(8):
            engine.add_request(make_request(rid=f"f{i}", prompt_ids=[1, 600 + i, 30], params=greedy(400),
                                       adapter="pol"))
        for _ in range(4):
            engine.step()
    for k in range(1, publishes + 1):
        config, blob = blobs[k]
        t0 = time.perf_counter()
        v = engine.load_adapter("pol", config=config, weights=blob).version
        if follow:
            engine.follow_latest()
        else:
            engine.add_request(make_request(rid=f"n{k}", prompt_ids=NEW_REQUEST_PROMPT[:-1] + [77 + k], params=greedy(2),
                                       adapter="pol"))
        seen: list[float] = []

        def watch(outs: list) -> None:
            if not seen and any(o.version == v and o.token_ids for o in outs):
                seen.append(time.perf_counter())

        while not seen:  # the first token when the engine hands it out (emit: before a decode pass)
            watch(engine.step(emit=watch))
        lat.append(1000 * (seen[0] - t0))
        if not follow:
            drain(engine)
    for rid in engine.request_ids():
        engine.abort(rid)
    drain(engine)
    return lat


def served_publish_latency(model_dir: Path, publishes: int, streams: int = 8) -> tuple[list[float], dict]:
    """Through parallm-launch: a trainer's AdapterPublisher sends version v on the engine's adapters
    SUB socket and a raw client at once submits a request that needs v (min_version, hold policy);
    the time until that request's first token (tagged v) reaches the client, while `streams`
    base-model streams keep the engine stepping."""
    import asyncio

    from parallm.client import AsyncClient, ClientError
    from parallm.training.publisher import AdapterPublisher
    from perf.bench_gpu import served

    server = served(model_dir, 32, ["--adapters.staleness-policy", "hold"], kv_budget_mb=2048)
    blobs = [lora_blob_for_dir(model_dir, k) for k in range(publishes + 1)]

    engine_side: dict = {}

    async def run() -> list[float]:
        lat = []
        async with AsyncClient(server.router, timeout=600) as client:
            pub = AdapterPublisher(client.welcome.addresses["adapters"])
            pub.publish("pol", 1, blobs[0][1], blobs[0][0])
            for _ in range(100):  # until version 1 is loaded (a request for an unknown adapter is a 404)
                try:
                    await first_token(client, 1, "warm")
                    break
                except ClientError:
                    await asyncio.sleep(0.1)
            busy = [asyncio.create_task(drain_stream(client, i)) for i in range(streams)]
            await asyncio.sleep(0.5)
            for k in range(1, publishes + 1):
                t0 = time.perf_counter()
                pub.publish("pol", k + 1, blobs[k][1], blobs[k][0])
                await first_token(client, k + 1, f"n{k}")
                lat.append(1000 * (time.perf_counter() - t0))
                await asyncio.sleep(0.02)
            engine_side.update(msgspec.to_builtins(await client.stats()))
            await client.abort(all=True)
            for task in busy:
                task.cancel()
            pub.close(0)
        return lat

    async def first_token(client, version: int, tag: str) -> None:
        async for out in client.stream(NEW_REQUEST_PROMPT[:-1] + [77 + version], greedy(1), adapter="pol",
                                       min_version=version):
            if out.token_ids:
                assert out.version == version, (out.version, version)
                return

    async def drain_stream(client, i: int) -> None:
        try:
            async for _ in client.stream([1, 600 + i, 30], greedy(4000)):
                pass
        except Exception:  # noqa: BLE001 - aborted at the end
            pass

    try:
        lat = asyncio.run(run())
    finally:
        server.stop()
    return lat, {"adapter_load_to_first_token_ms": engine_side.get("adapters", {}).get("load_to_first_token_ms"),
                 "step_ms_mean": engine_side.get("step_ms_mean"), "stage_ms_mean": engine_side.get("loop", {}).get("ms_mean"),
                 "decode_batch_hist": engine_side.get("decode_batch_hist")}


def lora_blob_for_dir(model_dir: Path, seed: int) -> tuple[dict, bytes]:
    """lora_blob for a model directory's shape, without loading the model (numpy, rank 16)."""
    import numpy as np

    cfg = json.loads((model_dir / "config.json").read_text())
    rng = np.random.default_rng(seed)
    h, hd = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * hd, "v_proj": cfg["num_key_value_heads"] * hd}
    w = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, o in outs.items():
            path = f"model.layers.{layer}.self_attn.{proj}"
            w[f"{path}.lora_a"] = mx.array((rng.standard_normal((h, 16)) / h ** 0.5).astype(np.float32))
            w[f"{path}.lora_b"] = mx.array((rng.standard_normal((16, o)) * 0.02).astype(np.float32))
    config = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": {"rank": 16, "scale": 2.0, "dropout": 0.0}}
    return config, save_bytes(w)


NEW_REQUEST_PROMPT = [1, 504, 3458, 282, 2, 77]
MERGE_VARIANTS = (("_merged", 256), ("_factored", 0))  # adapters.merge_mb: the GPU's and the CPU's default


def bare_pass_ms(model, tokens: list[list[int]], reps: int = 12) -> float:
    """mlx-lm's own forward over `tokens` with a fresh cache, an argmax and its read (median ms):
    what the pass that samples a first token costs with no engine and no adapter around it."""
    from mlx_lm.models.cache import make_prompt_cache

    times = []
    for _ in range(reps + 3):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(mx.array(tokens), cache=cache)
        mx.argmax(logits[:, -1, :], axis=-1).tolist()
        times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times[3:]), 2)


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(statistics.median(xs), 2), "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 2),
            "min_ms": round(xs[0], 2), "max_ms": round(xs[-1], 2)}


def report(r: dict, results: Results) -> str:
    m = results.machine
    lines = [f"# Adapters on {m['gpu'] or 'the CPU'}", "", f"Command: `{results.command}`  ",
             f"Machine: {describe(m)}; load average at start {tuple(round(x, 1) for x in r['loadavg_at_start'])}, "
             f"at end {tuple(round(x, 1) for x in r['loadavg_at_end'])}.  ",
             f"Model: {r['model']}; adapter: {r['adapter']} ({r['blob_bytes']} bytes of safetensors).", "",
             f"## Decode throughput, {r['rows']} rows x {r['decode_tokens']} tokens", "",
             "| batch | tokens/s | vs base |", "|---|---|---|"]
    for k, v in r["decode_tokens_per_s"].items():
        lines.append(f"| {k} | {v} | {r['relative_to_base'][k]} |")
    if "bare_pass_ms" in r:
        lines += ["", "## One bare mlx-lm pass (fresh cache, argmax read; no engine, no adapter)", "",
                  "| pass | ms |", "|---|---|"] + [f"| {k} | {v} |" for k, v in r["bare_pass_ms"].items()]
    lines += ["", "## Publish -> first token under the new version", "", "| measure | n | p50 ms | p90 ms | min | max |",
              "|---|---|---|---|---|---|"]
    for k, m in r.items():
        if not (isinstance(m, dict) and "p50_ms" in m):
            continue
        lines.append(f"| {k} | {m['n']} | {m['p50_ms']} | {m['p90_ms']} | {m['min_ms']} | {m['max_ms']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from parallm import blas

    if not blas.is_preloaded() and blas.openblas_env() is not None:
        blas.reexec_with_openblas()  # MLX's Linux CPU wheel links a reference BLAS ~15-60x slower
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--publishes", type=int, default=30)
    ap.add_argument("--shape", default="", help="a perf.bench_gpu shape with random weights instead of the default model")
    ap.add_argument("--tokenizer-dir", type=Path, help="with --shape: a directory with tokenizer.json etc.")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-bench-gpu"))
    ap.add_argument("--served", action="store_true", help="with --shape: also publish through parallm-launch")
    add_results_options(ap)
    args = ap.parse_args()
    results = Results.from_args("adapters", args)
    if args.shape:
        from perf.bench_gpu import build_model_dir

        model_dir = build_model_dir(args.shape, args.work_dir / args.shape, args.tokenizer_dir)
        loaded = load_model(ModelConfig(path=str(model_dir)))
        described = f"random weights of the {args.shape} shape, {loaded.dtype}"
    else:
        loaded = load_model(ModelConfig(dtype="float32"))
        described = "SmolLM2-135M (default), float32, CPU"
    model = loaded.model
    bare = {"new_request_prompt_6_tokens": bare_pass_ms(model, [NEW_REQUEST_PROMPT]),
            "decode_1_row": bare_pass_ms(model, [[1]]), "decode_8_rows": bare_pass_ms(model, [[1]] * 8),
            f"decode_{args.rows}_rows": bare_pass_ms(model, [[1]] * args.rows)}

    def engine(merge_mb: int | None = None) -> Engine:
        return Engine(EngineModel(model, tuple(loaded.eos_token_ids), 2048, loaded.vocab_size), Config(engine=EngineConfig(max_num_seqs=32, prefix_cache=False, kv_budget_mb=2048), adapters=AdaptersConfig(merge_mb=merge_mb)))

    res: dict = {"loadavg_at_start": os.getloadavg(), "model": described,
                 "adapter": f"LoRA rank 16 on q_proj+v_proj of all {len(model.layers)} layers", "rows": args.rows,
                 "decode_tokens": args.tokens, "bare_pass_ms": bare}
    e = engine()
    tp = {"base_no_adapters": throughput(e, [""], args.rows, args.tokens, "b")}
    blobs = [lora_blob(model, 16, k) for k in range(4)]
    for k, (c, b) in enumerate(blobs):
        e.load_adapter(f"a{k}", config=c, weights=b)
    tp["base_rows_adapters_loaded"] = throughput(e, [""], args.rows, args.tokens, "bl")
    for label, merge_mb in MERGE_VARIANTS:
        one = engine(merge_mb)
        one.load_adapter("a0", config=blobs[0][0], weights=blobs[0][1])
        tp[f"single_adapter{label}"] = throughput(one, ["a0"], args.rows, args.tokens, "s" + label)
        del one
    tp["mixed_4_adapters_plus_base"] = throughput(e, ["", "a0", "a1", "a2", "a3"], args.rows, args.tokens, "m")
    tp["mixed_2_adapters"] = throughput(e, ["a0", "a1"], args.rows, args.tokens, "m2")
    res["decode_tokens_per_s"] = {k: round(v, 1) for k, v in tp.items()}
    res["relative_to_base"] = {k: round(v / tp["base_no_adapters"], 3) for k, v in tp.items()}
    for label, merge_mb in MERGE_VARIANTS:
        e2 = engine(merge_mb)
        res[f"publish_to_first_token_new_request{label}"] = summary(publish_latency(e2, model, args.publishes, False))
        res[f"publish_to_first_token_running_streams{label}"] = summary(publish_latency(e2, model, args.publishes,
                                                                                        True))
        loads = []
        for k in range(10):
            c, b = lora_blob(model, 16, 50 + k)
            t1 = time.perf_counter()
            e2.load_adapter("loadonly", config=c, weights=b)
            loads.append(1000 * (time.perf_counter() - t1))
        res[f"load_adapter_only{label}"] = summary(loads)
        res[f"step_ms_mean{label}"] = e2.stats().step_ms_mean
        del e2
    res["blob_bytes"] = len(lora_blob(model, 16, 0)[1])
    if args.served and args.shape:
        del e
        lat, engine_side = served_publish_latency(model_dir, args.publishes)
        res["served_publish_to_first_token_new_request"] = summary(lat)
        res["served_engine"] = engine_side
        lat, engine_side = served_publish_latency(model_dir, args.publishes, streams=0)
        res["served_publish_to_first_token_idle_engine"] = summary(lat)
        res["served_engine_idle"] = engine_side
    res["loadavg_at_end"] = os.getloadavg()
    results.write(res, report(res, results))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
