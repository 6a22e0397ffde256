"""What every benchmark shares: a server to measure, the machine it ran on, and where its numbers go.

- `Server`: `parallm-launch` with a run dir and HTTP port of its own, ready when the supervisor
  says so, its output kept, stopped with SIGTERM (then SIGKILL) and cleaned up. `Process` is the
  same for any other server (mlx_lm.server). Both live in parallm/launch/local.py (the end-to-end
  tests start their servers with it too); this module re-exports them.
- `machine()`: platform, CPUs, memory, MLX and its device, the GPU's name, the BLAS and allocator
  preloaded, the environment variables that change MLX's or OpenBLAS's speed.
- `Results`: one file per benchmark (and experiment) and device,
  perf/results/<benchmark>[-<experiment>]-<device>.json (.md, .png beside it), overwritten by
  every run with the command and the machine inside; earlier numbers live in git's history.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from parallm.launch.local import (READY_LINE, Process, Server, cpu_delta, free_port, free_port_range,  # noqa: F401
                                  launch_command, server_env)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
SPEED_ENV = ("MLX_", "OPENBLAS_", "PARALLM_NO_", "GLIBC_TUNABLES", "CUDA_VISIBLE_DEVICES")

# the servers the benchmarks measure (parallm.launch.local; the end-to-end tests start theirs with it too)
__all__ = ["READY_LINE", "Process", "Server", "cpu_delta", "free_port", "free_port_range", "launch_command",
           "server_env", "ROOT", "RESULTS", "Results", "add_results_options", "command", "describe",
           "device_slug", "graph_primitives", "machine"]


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


def per_call_us(fn: Callable[[], Any], repeats: int) -> float:
    """Microseconds per call of `fn` over `repeats` calls, after one call outside the timing (warm-up)."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e6 * (time.perf_counter() - start) / repeats


def command(argv: list[str] | None = None) -> str:
    """How this script was run: `python -m perf.NAME ARGS`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([prog, shlex.join(sys.argv[1:] if argv is None else argv)]).strip()


# ---------------------------------------------------------------------------- graphs

def graph_primitives(arrays: list) -> "collections.Counter[str]":
    """The operations of the MLX graph of `arrays` (not evaluated), by primitive name: what
    `mx.export_to_dot` draws as operations (what a pass builds, and on a GPU mostly launches)."""
    import collections
    import tempfile

    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        text = Path(f.name).read_text()
    return collections.Counter(m.group(1) for line in text.splitlines()
                               if "shape=rectangle" in line and (m := re.search(r'label ="([^"]*)"', line)))


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
