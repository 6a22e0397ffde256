"""What every benchmark shares: a server to measure, the machine it ran on, and where its numbers go.

- `Server`: `parallm-launch` with a run dir and HTTP port of its own, ready when the supervisor
  says so, its output kept, stopped with SIGTERM (then SIGKILL) and cleaned up. `Process` is the
  same for any other server (mlx_lm.server). The end-to-end tests start their servers with it too.
- `machine()`: platform, CPUs, memory, MLX and its device, the GPU's name, the BLAS and allocator
  preloaded, the environment variables that change MLX's or OpenBLAS's speed.
- `Results`: one file per benchmark (and experiment) and device,
  perf/results/<benchmark>[-<experiment>]-<device>.json (.md, .png beside it), overwritten by
  every run with the command and the machine inside; earlier numbers live in git's history.

Servers get the checkout on PYTHONPATH (the GPU machine runs the scripts from a checkout with no
install) and, unless given another, this process's environment without its OpenBLAS/mimalloc
preloads, so that the supervisor decides what each stage preloads, as it does for a user.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
READY_LINE = "parallm-launch: ready"
SPEED_ENV = ("MLX_", "OPENBLAS_", "PARALLM_NO_", "GLIBC_TUNABLES", "CUDA_VISIBLE_DEVICES")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int = 10) -> int:
    """A first port whose next n - 1 are free too (over tcp:// the stages bind consecutive ports)."""
    for _ in range(50):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no range of free ports")


def launch_command() -> list[str]:
    """The installed `parallm-launch` script beside this Python, else `python -m parallm.launch`."""
    script = Path(sys.executable).with_name("parallm-launch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "parallm.launch"]


def server_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A server's environment: `env` as given, or by default this process's without its
    OpenBLAS/mimalloc preloads; the checkout first on PYTHONPATH either way."""
    from parallm import blas

    out = blas.without_preloads(dict(os.environ)) if env is None else dict(env)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p)])
    return out


# ---------------------------------------------------------------------------- servers

P = TypeVar("P", bound="Process")


class Process:
    """A server subprocess, ready once a line of its output contains `ready`; its output is kept
    in `lines` (echoed to stderr with PARALLM_E2E_ECHO=1)."""

    def __init__(self, argv: list[str], *, ready: str, env: Mapping[str, str] | None = None,
                 ready_timeout: float = 300.0) -> None:
        self.argv = argv
        self.ready = ready
        self.env = server_env(env)
        self.ready_timeout = ready_timeout
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self: P) -> P:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                     text=True, errors="replace", bufsize=1, start_new_session=True)
        threading.Thread(target=self._collect, daemon=True).start()
        name = Path(self.argv[0]).name
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if any(self.ready in line for line in self.lines):
                return self
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the reader thread takes the last lines
                self.stop()  # cleans up what the server had
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} not ready in {self.ready_timeout} s:\n{self.output()}")

    def _collect(self) -> None:
        echo = bool(os.environ.get("PARALLM_E2E_ECHO"))
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if echo:
                print(line, end="", file=sys.stderr)

    def output(self, last: int = 200) -> str:
        return "\n".join(self.lines[-last:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the process, kill it after `timeout` s; its exit status (0 if never started)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self: P) -> P:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Server(Process):
    """`parallm-launch ARGS` with a run dir (its ipc sockets) and HTTP port of its own."""

    def __init__(self, *args: str, env: Mapping[str, str] | None = None, ready_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.run_dir = tempfile.mkdtemp(prefix="parallm-server-")
        super().__init__([*launch_command(), "--port", str(self.port), "--transport.run-dir", self.run_dir, *args],
                         ready=READY_LINE, env=env, ready_timeout=ready_timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router(self) -> str:
        return f"ipc://{self.run_dir}/router.sock"

    @property
    def policy(self) -> str:
        """The policy stage's ROUTER (raw policy clients)."""
        return f"ipc://{self.run_dir}/policy.sock"

    @property
    def policy_weights(self) -> str:
        """The policy stage's weights SUB (trainers' PUBs connect here)."""
        return f"ipc://{self.run_dir}/policy-weights.sock"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        code = super().stop(sig, timeout)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return code

    def stage_processes(self) -> list[tuple[str, str, int]]:
        """(stage, replica, pid) of every stage process, from the supervisor's children's command lines
        in /proc (`ps` cuts them at the terminal width, 80 columns without one); [] without /proc."""
        if self.proc is None or not os.path.isdir("/proc"):
            return []
        found = []
        for pid in _run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)]).split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            except OSError:
                continue
            if "parallm.stages" not in argv or argv.index("parallm.stages") + 1 >= len(argv):
                continue
            replica = argv[argv.index("--replica") + 1] if "--replica" in argv[:-1] else "0"
            found.append((argv[argv.index("parallm.stages") + 1], replica, int(pid)))
        return found

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each stage process has used so far, by stage name
        (`tokenizer-1` for a second replica) and `supervisor`; {} where /proc is missing (macOS)."""
        if self.proc is None or not os.path.isdir("/proc"):
            return {}
        tick = os.sysconf("SC_CLK_TCK")
        out = {"supervisor": _proc_cpu(self.proc.pid, tick)}
        for name, replica, pid in self.stage_processes():
            out[name if replica == "0" else f"{name}-{replica}"] = _proc_cpu(pid, tick)
        return {k: v for k, v in out.items() if v is not None}


def _proc_cpu(pid: int, tick: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / tick


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-process CPU seconds between two `Server.cpu_seconds()` readings."""
    return {k: round(after[k] - before[k], 3) for k in after if k in before}


# ---------------------------------------------------------------------------- the machine

def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def processor() -> str:
    if sys.platform == "darwin":
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def gpu_name() -> str:
    """The GPU MLX computes on (nvidia-smi's name on CUDA, the chip on Apple silicon); "" on MLX's CPU device."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return ""
    if sys.platform == "darwin":
        return processor()
    names = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).splitlines()
    return names[0].strip() if names else str(mx.default_device())


def machine() -> dict[str, Any]:
    """What a number depends on besides the code (imports MLX)."""
    import importlib.metadata

    import mlx.core as mx

    from parallm import blas

    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory = None
    try:
        mlx_lm = importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        mlx_lm = None
    return {
        "platform": platform.platform(), "processor": processor(), "cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": memory, "python": platform.python_version(), "mlx": mx.__version__, "mlx_lm": mlx_lm,
        "device": str(mx.default_device()), "gpu": gpu_name(),
        "openblas_preloaded": blas.is_preloaded(), "allocator": blas.preloaded_allocator(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(SPEED_ENV)},
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def describe(info: Mapping[str, Any]) -> str:
    """One line of `machine()` for a report."""
    blas = "OpenBLAS preloaded" if info.get("openblas_preloaded") else "no BLAS preload"
    device = info.get("gpu") or info.get("device")
    env = ", ".join(f"{k}={v}" for k, v in info.get("env", {}).items())
    return (f"{info.get('processor')}, {info.get('cpus')} CPUs, {info.get('memory_gib')} GiB, {info.get('platform')}; "
            f"MLX {info.get('mlx')} on {device}, mlx-lm {info.get('mlx_lm')}; {blas}, {info.get('allocator')} "
            f"malloc; load average {info.get('loadavg')}" + (f"; {env}" if env else ""))


def device_slug(info: Mapping[str, Any]) -> str:
    """The device part of a results file name: `cpu`, `h100`, `a100`, `rtx-4090`, `apple-m2-max`."""
    name = info.get("gpu") or ""
    if not name:
        return "cpu"
    words = [w for w in name.split() if w.lower() not in ("nvidia", "geforce", "tesla")]
    if not name.lower().startswith("apple"):
        digit = next((i for i, w in enumerate(words) if re.search(r"\d", w)), len(words) - 1)
        words = words[:digit] + [words[digit].split("-")[0]]
    return re.sub(r"[^a-z0-9.]+", "-", " ".join(words).lower()).strip("-") or "gpu"


def command(argv: list[str] | None = None) -> str:
    """How this script was run: `python -m perf.NAME ARGS`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([prog, shlex.join(sys.argv[1:] if argv is None else argv)]).strip()


# ---------------------------------------------------------------------------- results

def add_results_options(parser: argparse.ArgumentParser, experiment: str = "", default_help: str = "") -> None:
    """--experiment (the results file's middle name), --out-dir, and --out for a run outside perf/results."""
    default = default_help or (repr(experiment) if experiment else "none")
    parser.add_argument("--experiment", default=experiment,
                        help="what this run tries when it is not the benchmark's plain run, in the results file's "
                             f"name: <benchmark>-<experiment>-<device>.json (default: {default})")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the results files go (%(default)s)")
    parser.add_argument("--out", type=Path, help="write the JSON exactly here instead (.md, .png beside it): for "
                                                 "numbers that do not belong in perf/results, such as an A/B's runs")


class Results:
    """The results files of one benchmark run: OUT_DIR/<benchmark>[-<experiment>]-<device>.json
    (and .md, .png). The machine is described when this is made (MLX is imported)."""

    def __init__(self, benchmark: str, experiment: str = "", out_dir: Path | None = None,
                 argv: list[str] | None = None, out: Path | None = None) -> None:
        self.machine = machine()
        self.command = command(argv)
        name = "-".join(part for part in (benchmark, experiment, device_slug(self.machine)) if part)
        self.stem = Path(out_dir or RESULTS) / name
        if out is not None:  # an explicit path: its name, less a .json suffix
            self.stem = Path(out).with_name(Path(out).name.removesuffix(".json"))
        self.out_dir = self.stem.parent
        self.out_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_args(cls, benchmark: str, args: argparse.Namespace, argv: list[str] | None = None,
                  experiment: str = "") -> "Results":
        """From add_results_options' arguments; `experiment` names the run when --experiment does not."""
        return cls(benchmark, args.experiment or experiment, args.out_dir, argv, args.out)

    def path(self, suffix: str) -> Path:
        return self.stem.with_name(self.stem.name + suffix)  # not with_suffix: names hold dots ("llama-3.2-3b")

    @property
    def json(self) -> Path:
        return self.path(".json")

    @property
    def md(self) -> Path:
        return self.path(".md")

    @property
    def png(self) -> Path:
        return self.path(".png")

    def previous(self) -> dict[str, Any]:
        """The record the last run left in this file ({} if none)."""
        return json.loads(self.json.read_text()) if self.json.is_file() else {}

    def write(self, data: Mapping[str, Any], markdown: str | None = None) -> Path:
        """Write `data` with the command and the machine first (again after each step of a long run)."""
        record = {"command": self.command, "machine": self.machine,
                  **{k: v for k, v in data.items() if k not in ("command", "machine")}}
        self.json.write_text(json.dumps(record, indent=2) + "\n")
        if markdown is not None:
            self.md.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
        return self.json
