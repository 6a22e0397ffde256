"""Start and stop a real `parallm-launch` for end-to-end tests."""

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
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command() -> list[str]:
    script = Path(sys.executable).with_name("parallm-launch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "parallm.launch"]


class Server:
    """A parallm-launch process with its own run dir and port; output kept for assertions."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.run_dir = tempfile.mkdtemp(prefix="parallm-e2e-")
        self.args = ["--port", str(self.port), "--transport.run-dir", self.run_dir, *args]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router(self) -> str:
        return f"ipc://{self.run_dir}/router.sock"

    def start(self) -> "Server":
        self.proc = subprocess.Popen([*launch_command(), *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=self.env, text=True, bufsize=1)
        threading.Thread(target=self._collect, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"parallm-launch exited with {self.proc.returncode}:\n{self.output()}")
            if any("parallm-launch: ready" in line for line in self.lines):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"parallm-launch not ready in {self.ready_timeout} s:\n{self.output()}")

    def _collect(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if os.environ.get("PARALLM_E2E_ECHO"):
                print(line, end="", file=sys.stderr)

    def output(self) -> str:
        return "\n".join(self.lines[-200:])

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until /health says every stage is up (after a restart)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy within {timeout} s:\n{self.output()}")

    def wait_restarted(self, stage: str, old_pid: int, timeout: float = 120.0) -> None:
        """Until `stage` runs under a new pid and /health says every stage is up again."""
        deadline = time.monotonic() + timeout
        while self.stage_pids().get(stage, old_pid) == old_pid:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stage} not restarted within {timeout} s:\n{self.output()}")
            time.sleep(0.1)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def stage_pids(self) -> dict[str, int]:
        """pid of every stage process, from the supervisor's children."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        pids = {}
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            parts = args.split()
            if "parallm.stages" in parts:
                name = parts[parts.index("parallm.stages") + 1]
                replica = parts[parts.index("--replica") + 1] if "--replica" in parts else "0"
                pids[name if name != "tokenizer" else f"tokenizer-{replica}"] = int(pid)
        return pids

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
