"""What one tensor-parallel all-sum costs a decode step, under each transport setting (issue 38).

On 2 x H200 a TP=2 decode step of the 3B shape took 10.9 ms against one GPU's 4.6 (main a295bb3,
perf/results/parallel-tpdp-3b-h200.md), and the ranks' probe put 56 chained all-sums of one row at
3.3 ms: ~59 us each, where NCCL's small all-reduce over NVLink is usually ~10-20 us. This starts a
fresh pair of ranks per setting (an environment: NCCL's protocol / algorithm / P2P level, MLX's CUDA
graphs off, both GPUs visible to each rank) and times, on rank 0:
- `alone_us`: one all-sum of a decode row's hidden state evaluated on its own (a host round trip);
- `chain_us`: per all-sum, `2 x layers` all-sums chained in one graph;
- `step_us` / `step_no_sum_us`: a decode-like chain (`2 x layers` matmuls of the rank's shard with an
  all-sum after each, one row) and the same without the all-sums: their difference is what the
  collectives add to a step, host launch and device time together; `build_us` the host time to build
  and launch the step's graph (mx.async_eval returns), the rest is waiting for the device;
- with NCCL_DEBUG=INFO in a setting, the transport lines NCCL printed (P2P, SHM, NET ...).

    python -m perf.probe_allsum --settings default "MLX_USE_CUDA_GRAPHS=0" "NCCL_PROTO=LL" \\
        --out perf/results/allsum-probe-h200.json

On a CPU it runs the ring backend (a smoke run; `--backend ring`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from .harness import command, machine, per_call_us


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(args: argparse.Namespace) -> None:
    import mlx.core as mx

    rank = int(os.environ["MLX_RANK"])
    if args.gpu_per_rank_visible_all and mx.cuda.is_available():
        mx.set_default_device(mx.Device(mx.gpu, rank))
    group = mx.distributed.init(strict=True, backend=args.backend)
    dtype = mx.bfloat16 if args.backend == "nccl" else mx.float32
    hidden, sums = args.hidden, 2 * args.layers
    x = mx.ones((1, hidden), dtype=dtype)
    mx.eval(mx.distributed.all_sum(x, group=group))

    def chain() -> None:
        y = x
        for _ in range(sums):
            y = mx.distributed.all_sum(y, group=group) * 0.5
        mx.eval(y)

    shard = max(1, args.intermediate // group.size())
    w_in = mx.random.normal((hidden, shard)).astype(dtype) * 0.01
    w_out = mx.random.normal((shard, hidden)).astype(dtype) * 0.01
    mx.eval(w_in, w_out)
    build: list[float] = []

    def step(with_sum: bool) -> None:
        t0 = time.perf_counter()
        y = x
        for i in range(sums):
            y = (y @ w_in) @ w_out if i % 2 else mx.tanh(y @ w_in) @ w_out
            if with_sum:
                y = mx.distributed.all_sum(y, group=group)
        mx.async_eval(y)
        build.append(time.perf_counter() - t0)
        mx.eval(y)

    out = {
        "alone_us": round(per_call_us(lambda: mx.eval(mx.distributed.all_sum(x, group=group)), args.repeats), 2),
        "chain_us": round(per_call_us(chain, max(1, args.repeats // 5)) / sums, 2),
    }
    build.clear()
    out["step_no_sum_us"] = round(per_call_us(lambda: step(False), args.repeats), 1)
    out["build_no_sum_us"] = round(1e6 * sum(build[1:]) / max(1, len(build) - 1), 1)
    build.clear()
    out["step_us"] = round(per_call_us(lambda: step(True), args.repeats), 1)
    out["build_us"] = round(1e6 * sum(build[1:]) / max(1, len(build) - 1), 1)
    out["sum_in_step_us"] = round((out["step_us"] - out["step_no_sum_us"]) / sums, 2)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _run_setting(setting: str, args: argparse.Namespace, ranks: int) -> dict:
    extra = {} if setting == "default" else dict(kv.split("=", 1) for kv in setting.split(","))
    visible_all = extra.pop("VISIBLE", "") == "all"
    env = {**os.environ, **extra, "MLX_WORLD_SIZE": str(ranks)}
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    hostfile = None
    if args.backend == "nccl":
        env.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(_free_port()))
    else:
        hostfile = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump([[f"127.0.0.1:{_free_port()}"] for _ in range(ranks)], hostfile)
        hostfile.close()
        env["MLX_HOSTFILE"] = hostfile.name
    argv = [sys.executable, "-m", "perf.probe_allsum", "--child", "--backend", args.backend,
            "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--layers", str(args.layers),
            "--repeats", str(args.repeats)] + (["--gpu-per-rank-visible-all"] if visible_all else [])
    procs = []
    for rank in range(ranks):
        rank_env = {**env, "MLX_RANK": str(rank)}
        if args.backend == "nccl" and not visible_all:
            rank_env["CUDA_VISIBLE_DEVICES"] = str(rank)
        procs.append(subprocess.Popen(argv, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=args.timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n(timed out)")
    if hostfile:
        os.unlink(hostfile.name)
    row: dict = {"setting": setting}
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[len("RESULT "):]))
    transports = sorted({line.split("NCCL INFO", 1)[1].strip() for out in outputs for line in out.splitlines()
                         if "NCCL INFO" in line and (" via " in line or "NCCL version" in line)})
    if transports:
        row["nccl_lines"] = transports[:12]
    if "alone_us" not in row:
        row["error"] = "\n".join(outputs[0].splitlines()[-8:])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["default"],
                        help="'default' or comma-separated NAME=VALUE environment settings per run; "
                             "VISIBLE=all shows both GPUs to each rank (it picks its own)")
    parser.add_argument("--backend", default=None, help="nccl (a CUDA machine's default) or ring")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=3072, help="the 3B shape's hidden size")
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-per-rank-visible-all", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend is None:
        import mlx.core as mx

        args.backend = "nccl" if mx.cuda.is_available() and mx.distributed.is_available("nccl") else "ring"
    if args.child:
        _child(args)
        return
    rows = []
    for setting in args.settings:
        row = _run_setting(setting, args, args.ranks)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command(), "machine": machine(), "backend": args.backend, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
