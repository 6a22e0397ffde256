"""The end-to-end tests' server: `parallm.launch.local.Server` (parallm-launch with its own run dir and
port, output kept; the benchmarks start theirs with it too) plus what the fault tests watch: health and
stage restarts."""

from __future__ import annotations

import time

import httpx

from parallm.launch.local import Server as LaunchedServer
from parallm.launch.local import free_port, free_port_range

__all__ = ["Server", "free_port", "free_port_range"]


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
        """pid of every stage process (tokenizers as `tokenizer-<replica>`, trainers after the first as
        `trainer-<replica>`), from the supervisor's children."""
        return {f"{name}-{replica}" if name == "tokenizer" or (name == "trainer" and replica != "0") else name: pid
                for name, replica, pid in self.stage_processes()}
