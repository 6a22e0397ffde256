"""The end-to-end tests' server: the benchmarks' `perf.harness.Server` (parallm-launch with its own
run dir and port, output kept) plus what the fault tests watch: health and stage restarts."""

from __future__ import annotations

import subprocess
import time

import httpx

from perf.harness import Server as LaunchedServer
from perf.harness import free_port

__all__ = ["Server", "free_port"]


class Server(LaunchedServer):
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
        """pid of every stage process, from the supervisor's children.

        Reads /proc rather than `ps`, which cuts `args` to the terminal width (80 columns without one)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        pids = {}
        for pid in out.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
            except OSError:
                continue
            if "parallm.stages" in parts and parts.index("parallm.stages") + 1 < len(parts):
                name = parts[parts.index("parallm.stages") + 1]
                has_replica = "--replica" in parts and parts.index("--replica") + 1 < len(parts)
                replica = parts[parts.index("--replica") + 1] if has_replica else "0"
                pids[name if name != "tokenizer" else f"tokenizer-{replica}"] = int(pid)
        return pids
