"""Tensor-parallel tests' rank processes: the same script started as N ranks of MLX's ring backend
over localhost, as parallm's supervisor starts an engine group."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from parallm.launch.group import rank_env, write_ring_hostfile

ROOT = Path(__file__).resolve().parents[1]


def run_ring(script: str, arg: str, tmp_path: Path, ranks: int, env: dict[str, str],
             timeout_s: float = 600.0) -> list[int]:
    """Run `python script arg` as `ranks` ring ranks (hostfile in tmp_path) and return their exit codes.
    A rank that fails ends the run at once (the others, which may wait on it in a collective, are
    killed: -9 in their place), as does `timeout_s`."""
    hostfile = write_ring_hostfile(tmp_path / "ring.json", ranks)
    procs = [subprocess.Popen([sys.executable, script, arg], env=rank_env(env, r, hostfile), cwd=ROOT)
             for r in range(ranks)]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.wait() for p in procs]
