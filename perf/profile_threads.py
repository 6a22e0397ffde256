"""Which thread of which stage process spends the CPU of a served run (issue 24).

Starts `parallm-launch`, runs a closed loop of streaming requests at each concurrency (OpenAI HTTP
by default, `--target zmq` for the raw client) and reads, before and after each run, the CPU time
of every thread of every stage process and of the supervisor (/proc/PID/task/TID/stat; the name
is the OS thread name: our Python threads name themselves (parallm/threads.py), libzmq's are
ZMQbg/..., CUDA's cuda-EvtHandlr/cuda0...; the thread whose id is the process id is `main`, and
threads that native libraries (MLX, OpenBLAS) start carry the process's name). It also records:

- the stage processes' own thread samplers (PARALLM_THREAD_SAMPLES, parallm/threads.py; off with
  `--sample-ms 0`): where each Python thread stood, and how late the sampler got the GIL back
  (`late_ms`: time another thread held the GIL or the CPU was busy);
- with py-spy (on PATH, /tmp/site/bin, or `--py-spy PATH`; `--py-spy off` skips it): two
  non-blocking recordings of the engine stage per run, every thread's on-CPU samples (`active`) and
  the GIL holder's (`gil`), with the innermost frames of each;
- the engine stage loop's split per step (stats' `loop`: inbox, step, send, beat).

    python -m perf.profile_threads --concurrency 1,16 --max-tokens 64   # -> perf/results/threads-cpu.{json,md}
    bash perf/gpu_runs.sh threads          # llama-3.2-3b shape at c=1 and 256 -> threads-llama-3.2-3b-<gpu>.*

py-spy on the GPU machine (no registry): its binary (static, any Python) in the git-ignored
.gpu/tools, carried with the call (`pip install --no-deps --target /tmp/pyspy py-spy==0.4.2 && cp
/tmp/pyspy/bin/py-spy .gpu/tools/`), or its wheel put beside the staged ones in .gpu/b before the
install call (install.sh puts the binary in /tmp/site/bin); gpu_runs.sh looks in both. Without it (or
where ptrace is not allowed) the rest of the profile still runs and the py-spy fields say why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Self

from perf.harness import Results, Server, add_results_options, describe
from perf.loadgen import WORKLOADS, Workload, run_http, run_zmq
from perf.pyspy import NativeDumps, PySpy, find_py_spy

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---------------------------------------------------------------------------- /proc

def threads_of(pid: int) -> dict[int, tuple[str, float, int]]:
    """tid -> (OS thread name, CPU seconds so far, context switches so far: each a wake-up or a
    preemption) of every thread of `pid`."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, _, tail = f.read().rpartition(")")
            fields = tail.split()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
            out[int(tid)] = (head.partition("(")[2], (int(fields[11]) + int(fields[12])) / TICK, switches)
        except (OSError, IndexError, ValueError):
            continue
    return out


def processes(server: Server) -> dict[str, int]:
    """Label -> pid: the supervisor and each stage process (`tokenizer-1` for a second replica)."""
    found = {"supervisor": server.proc.pid}
    for stage, replica, pid in server.stage_processes():
        found[stage if replica == "0" else f"{stage}-{replica}"] = pid
    return found


def snapshot(procs: dict[str, int]) -> dict[str, dict[int, tuple[str, float, int]]]:
    return {label: threads_of(pid) for label, pid in procs.items()}


class StateSampler:
    """Every `interval_s` while a run lasts, each thread's scheduler state and, when asleep, the kernel
    function it sleeps in (/proc/PID/task/TID/stat and wchan): a thread that is always `R` with no
    wait burns its core (a spin), one asleep in futex_wait or do_epoll_wait is blocked."""

    def __init__(self, procs: dict[str, int], interval_s: float = 0.05) -> None:
        self.procs, self.interval_s = procs, interval_s
        self.counts: dict[str, dict[int, Counter[str]]] = {label: {} for label in procs}
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.rounds += 1
            for label, pid in self.procs.items():
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    where = thread_state(pid, tid)
                    if where:
                        self.counts[label].setdefault(int(tid), Counter())[where] += 1

    def of(self, label: str, tid: int, top: int = 3) -> dict[str, float]:
        counts = self.counts.get(label, {}).get(tid, Counter())
        total = max(1, sum(counts.values()))
        return {k: round(v / total, 3) for k, v in counts.most_common(top)}


def thread_state(pid: int, tid: str) -> str:
    """`R` (running or runnable), else `S:<wchan>` / `D:<wchan>`; '' when the thread is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        if state == "R":
            return "R"
        with open(f"/proc/{pid}/task/{tid}/wchan") as f:
            return f"{state}:{f.read().strip() or '?'}"
    except (OSError, IndexError):
        return ""


def thread_table(procs: dict[str, int], before: dict, after: dict, wall: float, tokens: int,
                 py_names: dict[int, str], states: StateSampler | None = None) -> dict[str, Any]:
    """Per process: CPU seconds, per token, and each thread's seconds and share of the run's wall time."""
    table = {}
    for label, pid in procs.items():
        rows = []
        for tid, (comm, cpu, switches) in after.get(label, {}).items():
            _, cpu0, switches0 = before.get(label, {}).get(tid, (comm, 0.0, 0))
            spent = cpu - cpu0
            name = "main" if tid == pid else py_names.get(tid) or comm
            rows.append({"tid": tid, "name": name, "cpu_s": round(spent, 3), "cpu_pct_of_wall": round(100 * spent / wall, 1),
                         "switches_per_token": round((switches - switches0) / max(1, tokens), 2),
                         **({"states": states.of(label, tid)} if states is not None else {})})
        rows.sort(key=lambda r: -r["cpu_s"])
        total = sum(r["cpu_s"] for r in rows)
        table[label] = {"pid": pid, "cpu_s": round(total, 3), "cpu_pct_of_wall": round(100 * total / wall, 1),
                        "cpu_ms_per_token": round(1000 * total / max(1, tokens), 4), "threads": rows}
    return table


# ---------------------------------------------------------------------------- in-stage samplers

def read_samplers(where: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in where.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[data["pid"]] = {**data, "stage": path.stem.rsplit("-", 1)[0]}
    return out


def sampler_delta(before: dict[int, dict], after: dict[int, dict], top: int = 8) -> dict[str, Any]:
    """Per stage: samples, GIL-wait lateness, and each Python thread's most frequent frames over the run."""
    out = {}
    for pid, now in after.items():
        was = before.get(pid, {"samples": 0, "late_ms": 0.0, "threads": {}})
        samples = now["samples"] - was["samples"]
        threads = {}
        for tid, t in now["threads"].items():
            old = Counter(was["threads"].get(tid, {}).get("frames", {}))
            counts = Counter(t["frames"])
            counts.subtract(old)
            counts = +counts
            if counts:
                threads[f"{t['name']} ({tid})"] = {k: round(v / max(1, samples), 3) for k, v in counts.most_common(top)}
        out[now["stage"]] = {"samples": samples, "late_ms": round(now["late_ms"] - was["late_ms"], 1),
                             "late_ms_per_sample": round((now["late_ms"] - was["late_ms"]) / max(1, samples), 3),
                             "late_max_ms_so_far": now["late_max_ms"], "frame_share": threads}
    return out


# ---------------------------------------------------------------------------- runs

def engine_loop(router: str) -> dict[str, Any]:
    import msgspec

    from parallm.client import AsyncClient

    async def get() -> dict[str, Any]:
        async with AsyncClient(router, timeout=60) as client:
            return msgspec.to_builtins(await client.stats())

    stats = asyncio.run(get())
    return {"steps": stats.get("steps", 0), "loop": stats.get("loop", {})}


def loop_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The stage loop's ms per step (inbox, step, send, beat) over the steps between two readings."""
    n0, n1 = before["loop"].get("steps", 0), after["loop"].get("steps", 0)
    if n1 <= n0:
        return {}
    was = before["loop"].get("ms_mean", {})
    return {k: round((v * n1 - was.get(k, 0.0) * n0) / (n1 - n0), 4) for k, v in after["loop"].get("ms_mean", {}).items()}


def python_names(samplers: dict[int, dict[str, Any]]) -> dict[int, str]:
    """tid -> Python thread name, from the stage samplers (for threads that did not name themselves)."""
    return {t["tid"]: t["name"] for s in samplers.values() for t in s["threads"].values() if t.get("tid")}


def run_level(server: Server, args: argparse.Namespace, concurrency: int, eos: list[int], samples_dir: Path,
              spy: str | None, work: Path) -> dict[str, Any]:
    workload = Workload(**{**WORKLOADS[args.workload].__dict__, "max_tokens": args.max_tokens,
                           "requests": max(args.min_requests, concurrency * args.requests_per_client)})
    procs = processes(server)
    time.sleep(1.2)  # the samplers' files are at most ~1 s old
    samplers_before = read_samplers(samples_dir)
    loop_before = engine_loop(server.router)
    recorder = PySpy(spy, procs["engine"], args.py_spy_rate, work) if spy and "engine" in procs else None
    states = StateSampler(procs)
    dumps = NativeDumps(spy, procs["engine"], args.native_dumps) if spy and args.native_dumps and "engine" in procs \
        else contextlib.nullcontext()
    before = snapshot(procs)
    start = time.perf_counter()
    with states, dumps:
        if args.target == "http":
            run = asyncio.run(run_http(server.url, "bench", workload, concurrency, eos, seed=concurrency,
                                       procs=args.client_procs if concurrency >= 16 else 1))
        else:
            run = asyncio.run(run_zmq(server.router, workload, concurrency, eos, seed=concurrency))
        wall = time.perf_counter() - start
        after = snapshot(procs)
    pyspy = recorder.stop() if recorder else None
    loop_after = engine_loop(server.router)
    time.sleep(1.2)
    samplers_after = read_samplers(samples_dir)
    tokens = run["output_tokens"]
    return {"concurrency": concurrency, "target": args.target, "requests": run["requests"], "ok": run["ok"],
            "output_tokens": tokens, "wall_s": round(wall, 3), "throughput_tok_s": round(run["throughput_tok_s"], 1),
            "ttft_p50_s": run["ttft_p50_s"], "itl_p50_s": run["itl_p50_s"], "client_cpu_s": run.get("client_cpu_s"),
            "engine_loop_ms_per_step": loop_delta(loop_before, loop_after),
            "engine_steps": loop_after["loop"].get("steps", 0) - loop_before["loop"].get("steps", 0),
            "engine_own_steps": loop_after["steps"] - loop_before["steps"],
            "processes": thread_table(procs, before, after, wall, tokens, python_names(samplers_after), states),
            "samplers": sampler_delta(samplers_before, samplers_after), "py_spy": pyspy,
            "native_dumps": dumps.report() if isinstance(dumps, NativeDumps) else None}


def markdown(report: dict[str, Any], results: Results, min_pct: float = 1.0) -> str:
    lines = [f"# Per-thread CPU of a served run ({report['target']}, {report['max_tokens']} output tokens)", "",
             f"Machine: {describe(results.machine)}", "", f"Command: `{results.command}`", ""]
    for level in report["levels"]:
        lines += [(f"## c={level['concurrency']}: {level['throughput_tok_s']} tok/s, {level['output_tokens']} tokens "
                   f"in {level['wall_s']} s"), "",
                  (f"Engine loop ms per working iteration: {level['engine_loop_ms_per_step']} ({level['engine_steps']} "
                   f"iterations, {level['engine_own_steps']} engine steps)"), "",
                  ("| process | thread | tid | CPU s | % of wall | process CPU ms per token | context switches per token "
                   "| states (share of samples) |"), "|---|---|---:|---:|---:|---:|---:|---|"]
        for label, proc in level["processes"].items():
            lines.append(f"| **{label}** | (all) | {proc['pid']} | {proc['cpu_s']} | {proc['cpu_pct_of_wall']} | "
                         f"{proc['cpu_ms_per_token']} | | |")
            for row in proc["threads"]:
                if row["cpu_pct_of_wall"] >= min_pct:
                    states = ", ".join(f"{k} {v:.0%}" for k, v in row.get("states", {}).items())
                    lines.append(f"| {label} | {row['name']} | {row['tid']} | {row['cpu_s']} | {row['cpu_pct_of_wall']} | "
                                 f"| {row['switches_per_token']} | {states} |")
        for stage, s in level["samplers"].items():
            lines += ["", (f"Sampler `{stage}`: {s['samples']} samples, GIL/CPU wait {s['late_ms_per_sample']} ms "
                           f"per sample (max so far {s['late_max_ms_so_far']} ms)")]
            for thread, frames in s["frame_share"].items():
                lines.append(f"- {thread}: " + "; ".join(f"{share:.0%} {where}" for where, share in list(frames.items())[:4]))
        if level.get("py_spy"):
            lines += ["", "py-spy (engine stage): samples per thread, on CPU (`active`) and holding the GIL (`gil`):"]
            for kind, data in level["py_spy"].items():
                lines.append(f"- {kind}: {data.get('error') or data['samples']}")
        if level.get("native_dumps"):
            dumps = level["native_dumps"]
            errors = f", errors: {'; '.join(dumps['errors'])}" if dumps["errors"] else ""
            took = f"{dumps['dumps']} dumps taking {dumps['dump_s']} s{errors}"
            lines += ["", f"py-spy dump --native of the engine stage ({took}):"]
            for thread, stacks in dumps["stacks"].items():
                lines.append(f"- {thread}: " + "; ".join(f"{n}x {stack}" for stack, n in stacks.items()))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--target", choices=("http", "zmq"), default="http")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--client-procs", type=int, default=1, help="HTTP client processes at c >= 16")
    parser.add_argument("--sample-ms", type=float, default=5.0, help="the stages' thread samplers' interval (0: off)")
    parser.add_argument("--py-spy", default="auto", help="py-spy binary, 'auto' (PATH, /tmp/site/bin) or 'off'")
    parser.add_argument("--py-spy-rate", type=int, default=200)
    parser.add_argument("--native-dumps", type=int, default=5,
                        help="py-spy dump --native of the engine stage, every 0.5 s of each run, at most this many "
                             "(each stops it for a moment; 0: none)")
    parser.add_argument("--server-args", default="", help="extra parallm-launch arguments")
    parser.add_argument("--shape", help="a perf.bench_gpu shape (random weights, the default tokenizer's vocabulary)")
    parser.add_argument("--work-dir", default="")
    parser.add_argument("--tokenizer-dir", default="")
    add_results_options(parser)
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if args.shape:
        from perf.bench_serving import shape_model_dir

        model = ["--model.path", str(shape_model_dir(args))]
    else:
        model = []
    results = Results.from_args("threads", args, argv)
    work = Path(tempfile.mkdtemp(prefix="profile-threads-"))
    samples_dir = work / "samples"
    env = None
    if args.sample_ms > 0:
        from parallm import blas

        env = blas.without_preloads(dict(os.environ))
        env.update({"PARALLM_THREAD_SAMPLES": str(samples_dir), "PARALLM_THREAD_SAMPLE_MS": str(args.sample_ms)})
    spy = find_py_spy(args.py_spy)
    report: dict[str, Any] = {"target": args.target, "max_tokens": args.max_tokens, "sample_ms": args.sample_ms,
                              "py_spy": spy, "levels": []}
    eos = [2]
    server = Server(*model, "--engine.max-num-seqs", str(max(levels)), "--model.served-name", "bench",
                    *args.server_args.split(), env=env, ready_timeout=900).start()
    try:
        warm = Workload(**{**WORKLOADS[args.workload].__dict__, "max_tokens": 8, "requests": 2})
        asyncio.run(run_http(server.url, "bench", warm, 2, eos, seed=99_999))
        for c in levels:
            level = run_level(server, args, c, eos, samples_dir, spy, work)
            report["levels"].append(level)
            results.write(report, markdown(report, results))
            print(json.dumps({k: level[k] for k in ("concurrency", "throughput_tok_s", "wall_s")} |
                             {"engine": level["processes"].get("engine", {}).get("threads", [])[:6]}), flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(results.md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
