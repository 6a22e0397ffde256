"""An engine stage as a group of tensor-parallel ranks (parallm/engine/distributed.py).

The supervisor starts every rank itself, as `mlx.launch` would on one host: with the ring backend
(CPUs) each rank process gets MLX_RANK and MLX_HOSTFILE (a JSON list of each rank's ring address,
fresh ports on every start so a restart never meets the last group's sockets); with NCCL (CUDA GPUs)
MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP/NCCL_PORT and its own GPU (CUDA_VISIBLE_DEVICES = its rank),
as `mlx.launch --backend nccl` sets them. Each joins with `mx.distributed.init`. Rank 0 is the engine stage the supervisor talks to (READY,
heartbeats); the others are followers it only watches. Any rank that dies takes the group down: the
supervisor kills the rest and starts the group again (supervisor.py).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import IO

from .process import StageProcess, StageSpec

LOCALHOST = "127.0.0.1"


def free_ports(n: int, host: str = LOCALHOST) -> list[int]:
    """`n` ports free right now on `host` (held together while picked, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_ring_hostfile(path: Path, ranks: int, host: str = LOCALHOST) -> Path:
    """MLX's ring hostfile for `ranks` processes on this host: one `ip:port` list per rank."""
    path.write_text(json.dumps([[f"{host}:{port}"] for port in free_ports(ranks, host)]))
    return path


def rank_env(base: dict[str, str], rank: int, hostfile: Path) -> dict[str, str]:
    """The environment of rank `rank`: the engine's, plus what MLX's ring backend reads."""
    return {**base, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}


def nccl_rank_env(base: dict[str, str], rank: int, ranks: int, port: int, first_gpu: int = 0) -> dict[str, str]:
    """The environment of rank `rank` of an NCCL group on this host: one GPU per rank (NVLink
    multicast off unless the environment says otherwise)."""
    return {**base, "MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(ranks), "NCCL_HOST_IP": LOCALHOST,
            "NCCL_PORT": str(port), "CUDA_VISIBLE_DEVICES": str(first_gpu + rank),
            "NCCL_NVLS_ENABLE": base.get("NCCL_NVLS_ENABLE", "0")}


class Followers:
    """Ranks 1..N-1 of one engine replica's group (rank 0 is the supervisor's engine StageProcess)."""

    def __init__(self, ranks: int, replica: int, env: dict[str, str], run_dir: Path, backend: str = "ring") -> None:
        self.ranks = ranks
        self.replica = replica
        self.env = env
        self.backend = backend
        self.hostfile = Path(run_dir) / f"engine-{replica}-ring.json"
        self.nccl_port = 0
        self.procs: list[StageProcess] = []

    def env_of(self, rank: int) -> dict[str, str]:
        if self.backend == "nccl":
            return nccl_rank_env(self.env, rank, self.ranks, self.nccl_port, first_gpu=self.replica * self.ranks)
        return rank_env(self.env, rank, self.hostfile)

    def prepare(self) -> dict[str, str]:
        """Fresh addresses for the next start of the group; returns rank 0's environment."""
        if self.backend == "nccl":
            self.nccl_port = free_ports(1)[0]
        else:
            write_ring_hostfile(self.hostfile, self.ranks)
        return self.env_of(0)

    def start(self, config: bytes, parent_read_fd: int, log_out: IO[str], json_logs: bool) -> None:
        """Start ranks 1..N-1 (after `prepare`, beside rank 0)."""
        self.procs = []
        for rank in range(1, self.ranks):
            spec = StageSpec("engine", replica=self.replica, env=self.env_of(rank))
            proc = StageProcess(spec)
            proc.start(config, parent_read_fd, log_out, json_logs)
            self.procs.append(proc)

    def dead(self) -> int | None:
        """The rank of a follower that exited, if one did."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.proc is not None and not proc.alive():
                return rank
        return None

    def exit_code(self, rank: int) -> int | None:
        return self.procs[rank - 1].exit_code()

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()

    def terminate(self, timeout: float) -> None:
        for proc in self.procs:
            proc.terminate(timeout)
