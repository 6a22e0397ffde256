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
import logging
import socket
from pathlib import Path
from typing import IO

from parallm import protocol

from .process import StageProcess, StageSpec

log = logging.getLogger("parallm.supervisor")

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


def write_ring_hostfile(path: Path, ranks: int, host: str = LOCALHOST, hosts: list[str] | None = None) -> Path:
    """MLX's ring hostfile for `ranks` processes: one `ip:port` list per rank, each at `hosts[rank]`
    (default: all at `host`), on ports free right now."""
    hosts = hosts or [host] * ranks
    ports: dict[str, list[int]] = {h: free_ports(hosts.count(h), h) for h in set(hosts)}
    path.write_text(json.dumps([[f"{h}:{ports[h].pop()}"] for h in hosts]))
    return path


class HostfileError(ValueError):
    """engine.hostfile cannot place the tensor-parallel ranks."""


def hostfile_hosts(path: str, ranks: int) -> list[str]:
    """The address of each rank from MLX's hostfile (what `mlx.launch --hostfile` reads: a JSON list
    of {"ssh": host, "ips": [address, ...]}, one entry per rank, rank 0 first). Every address must be
    this machine's for now: parallm starts the ranks itself (HostfileError otherwise)."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HostfileError(f"cannot read engine.hostfile {path!r}: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and (e.get("ips") or e.get("ssh"))
                                                for e in entries):
        raise HostfileError(f"engine.hostfile {path!r} is not MLX's hostfile: a JSON list of "
                            '{"ssh": HOST, "ips": [ADDRESS]} entries, one per rank')
    if len(entries) != ranks:
        raise HostfileError(f"engine.hostfile {path!r} names {len(entries)} rank(s); engine.tensor_parallel is {ranks}")
    hosts = [str((e.get("ips") or [e["ssh"]])[0]) for e in entries]
    for rank, host in enumerate(hosts):
        if not _local(host):
            raise HostfileError(f"engine.hostfile: rank {rank} is on {host}, not an address of this machine; parallm "
                                "starts every rank of a tensor-parallel engine on this machine for now (ranks on "
                                "other machines need mlx.launch over ssh: docs/operations.md)")
    return [socket.gethostbyname(host) for host in hosts]


def _local(host: str) -> bool:
    """Whether `host` is an address of this machine (one can bind to it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


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

    def __init__(self, ranks: int, replica: int, env: dict[str, str], run_dir: Path, backend: str = "ring",
                 hosts: list[str] | None = None) -> None:
        """`hosts`: each rank's ring address (engine.hostfile); default: all on 127.0.0.1."""
        self.ranks = ranks
        self.replica = replica
        self.env = env
        self.backend = backend
        self.hosts = hosts
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
            write_ring_hostfile(self.hostfile, self.ranks, hosts=self.hosts)
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


class RemoteReplicas:
    """Engine replicas started on other machines (engine.remote_replicas; parallm/launch/remote.py).
    The supervisor cannot start or restart them, but it hears their READY and heartbeats (over tcp,
    from CURVE keys it allows) and announces them as it does its own stages: StageUp once one is heard
    (checked from the supervisor's monitor loop, when every stage listens), StageDown when it has been
    silent for supervisor.dead_after_s or came back as a new process (the tokenizers route around it
    meanwhile and its requests fail retryably), StageUp when it is heard again."""

    def __init__(self, first: int, count: int) -> None:
        self.replicas = range(first, first + count)
        self.heard: dict[int, float] = {}
        self.pids: dict[int, int] = {}
        self.up: set[int] = set()
        self.restarted: set[int] = set()
        self.restarts: dict[int, int] = {}

    def hear(self, message: protocol.Message, now: float) -> bool:
        """Take a Ready / Heartbeat / Fatal if it is a remote replica's; False if it is not."""
        stage, replica = getattr(message, "stage", ""), getattr(message, "replica", -1)
        if stage != "engine" or replica not in self.replicas:
            return False
        if isinstance(message, protocol.Fatal):
            log.error("remote engine replica %d: %s", replica, message.message)
            return True
        if self.pids.get(replica, message.pid) != message.pid and replica in self.up:
            self.restarted.add(replica)  # a new process: what the old one held is lost
        self.pids[replica] = message.pid
        self.heard[replica] = now
        return True

    def check(self, now: float, silent_after_s: float) -> list[protocol.Message]:
        """The StageDown / StageUp announcements due now."""
        out: list[protocol.Message] = []
        for replica in self.replicas:
            at = self.heard.get(replica)
            alive = at is not None and now - at <= silent_after_s
            if replica in self.up and (not alive or replica in self.restarted):
                self.up.discard(replica)
                self.restarts[replica] = self.restarts.get(replica, 0) + 1
                log.error("remote engine replica %d %s", replica, "restarted" if alive else
                          f"silent for {now - at:.1f} s" if at is not None else "is gone")
                out.append(protocol.StageDown(stage="engine", replica=replica, restarts=self.restarts[replica]))
            elif alive and replica not in self.up:
                log.info("remote engine replica %d serves", replica)
                out.append(protocol.StageUp(stage="engine", replica=replica, restarts=self.restarts.get(replica, 0)))
                self.up.add(replica)
            self.restarted.discard(replica)
        return out
