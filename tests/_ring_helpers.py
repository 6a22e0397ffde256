"""Tensor-parallel tests' rank processes: the same script started as N ranks of MLX's ring backend
over localhost, as parallm's supervisor starts an engine group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from parallm.launch.group import rank_env, write_ring_hostfile

ROOT = Path(__file__).resolve().parents[1]


def run_ring(script: str, arg: str, tmp_path: Path, ranks: int, env: dict[str, str]) -> list[int]:
    """Run `python script arg` as `ranks` ring ranks (hostfile in tmp_path) and return their exit codes;
    a rank still running after 600 s is killed."""
    hostfile = write_ring_hostfile(tmp_path / "ring.json", ranks)
    procs = [subprocess.Popen([sys.executable, script, arg], env=rank_env(env, r, hostfile), cwd=ROOT)
             for r in range(ranks)]
    try:
        return [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
