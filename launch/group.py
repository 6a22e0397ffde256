"""An engine stage as a group of tensor-parallel ranks (parallm/engine/distributed.py).

The supervisor starts every rank itself, as `mlx.launch` would (ranks that engine.hostfile puts on
other machines over ssh: launch/remote_rank.py): with the ring backend
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
import random
import socket
from pathlib import Path
from typing import IO, Callable

from parallm import protocol
from parallm.protocol import RankStart

from .process import StageProcess, StageSpec
from .remote_rank import HostCheckError, RankHost, RemoteRank, check_hosts, ssh_argv

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


def write_ring_hostfile(path: Path, ranks: int, host: str = LOCALHOST, hosts: list[str] | None = None,
                        remote: frozenset[str] = frozenset()) -> Path:
    """MLX's ring hostfile for `ranks` processes: one `ip:port` list per rank, each at `hosts[rank]`
    (default: all at `host`), on ports free right now (on an address in `remote`, another machine's,
    which cannot be probed from here: a random port of REMOTE_PORTS, fresh on every start)."""
    hosts = hosts or [host] * ranks
    ports: dict[str, list[int]] = {h: random.sample(REMOTE_PORTS, hosts.count(h)) if h in remote
                                   else free_ports(hosts.count(h), h) for h in set(hosts)}
    path.write_text(json.dumps([[f"{h}:{ports[h].pop()}"] for h in hosts]))
    return path


REMOTE_PORTS = range(20000, 30000)  # ring ports on another machine (below Linux's ephemeral range)


class HostfileError(ValueError):
    """engine.hostfile cannot place the tensor-parallel ranks."""


def hostfile_ranks(path: str, ranks: int) -> list[RankHost]:
    """Where each rank runs, from MLX's hostfile (what `mlx.launch --hostfile` reads: a JSON list of
    {"ssh": host, "ips": [address, ...]} entries, or {"hosts": [...]}, one per rank, rank 0 first;
    parallm also reads an entry's optional "python" and "cwd" for a remote rank). Rank 0 is this
    server's engine stage, so its entry must be this machine; the others may be anywhere ssh reaches
    (HostfileError otherwise)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HostfileError(f"cannot read engine.hostfile {path!r}: {exc}") from None
    entries = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not all(isinstance(e, dict) and (e.get("ips") or e.get("ssh"))
                                                for e in entries):
        raise HostfileError(f"engine.hostfile {path!r} is not MLX's hostfile: a JSON list of "
                            '{"ssh": HOST, "ips": [ADDRESS]} entries, one per rank')
    if len(entries) != ranks:
        raise HostfileError(f"engine.hostfile {path!r} names {len(entries)} rank(s); engine.tensor_parallel is {ranks}")
    out = []
    for rank, e in enumerate(entries):
        address = str((e.get("ips") or [e.get("ssh")])[0])
        try:
            ip = socket.gethostbyname(address)
        except OSError as exc:
            raise HostfileError(f"engine.hostfile: rank {rank}'s address {address!r} does not resolve: {exc}") from None
        local = _local(ip)
        if rank == 0 and not local:
            raise HostfileError(f"engine.hostfile: rank 0 is on {address}, not an address of this machine; rank 0 is "
                                "this server's engine stage, so the first entry must be this machine")
        out.append(RankHost(rank=rank, ip=ip, ssh=str(e.get("ssh") or address), local=local,
                            python=str(e.get("python") or ""), cwd=str(e.get("cwd") or "")))
    return out


def place_ranks(config, ranks: int) -> list[RankHost] | None:
    """engine.hostfile's ranks, checked for this configuration (None without a hostfile). Ranks on other
    machines need the tcp transport with CURVE (rank 0's calls carry prompts and weights), one replica
    (the hostfile places one group), and ssh to each host where the model directory exists (checked now,
    so a missing one fails the start, naming the host). Raises HostfileError."""
    if not config.engine.hostfile:
        return None
    hosts = hostfile_ranks(config.engine.hostfile, ranks)
    remote = [h for h in hosts if not h.local]
    if not remote:
        return hosts
    where = ", ".join(f"rank {h.rank} on {h.ssh}" for h in remote)
    if config.transport.kind != "tcp" or not config.transport.curve_keys:
        raise HostfileError(f"engine.hostfile puts {where}: ranks on other machines need --transport.kind tcp "
                            "with CURVE on (transport.curve), since rank 0's calls to them carry prompts and weights")
    if config.engine.replicas != 1 or config.engine.remote_replicas:
        raise HostfileError(f"engine.hostfile puts {where}: ranks on other machines serve one engine replica "
                            "(engine.replicas=1, no engine.remote_replicas)")
    try:
        check_hosts(hosts, config.model.path)
    except HostCheckError as exc:
        raise HostfileError(f"engine.hostfile: {exc}") from None
    return hosts


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


RANK_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "MLX_USE_CUDA_GRAPHS": "0"}  # an NCCL rank's, where its environment is silent


def nccl_rank_env(base: dict[str, str], rank: int, ranks: int, port: int, gpu: int = 0,
                  host_ip: str = LOCALHOST) -> dict[str, str]:
    """The environment of rank `rank` of an NCCL group whose rank 0 is at `host_ip`: its own GPU `gpu`
    (of its machine); NVLink multicast and MLX's CUDA graphs off unless the environment says otherwise.

    Graphs off: MLX captures each all-sum's NCCL launch into the pass's CUDA graph, and on 2 x H200 that
    cost ~41 us of a decode step per all-sum against ~13 us launched directly (perf/probe_allsum.py,
    perf/results/allsum-probe-h200.json); a TP=2 step of the 3B shape holds 56 of them."""
    return {**base, "MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(ranks), "NCCL_HOST_IP": host_ip,
            "NCCL_PORT": str(port), "CUDA_VISIBLE_DEVICES": str(gpu),
            **{name: base.get(name, value) for name, value in RANK_DEFAULTS.items()}}


class Followers:
    """Ranks 1..N-1 of one engine replica's group (rank 0 is the supervisor's engine StageProcess);
    those engine.hostfile puts on other machines start over ssh (launch/remote_rank.py)."""

    def __init__(self, ranks: int, replica: int, env: dict[str, str], run_dir: Path, backend: str = "ring",
                 hosts: list[RankHost] | None = None, reach: Callable[[RankHost], list[str]] = ssh_argv) -> None:
        """`hosts`: where each rank runs (engine.hostfile); default: all on 127.0.0.1. `reach`: the command
        that starts a remote rank's entry on its host (ssh)."""
        self.ranks = ranks
        self.replica = replica
        self.env = env
        self.backend = backend
        self.hosts = hosts or [RankHost(rank=r, ip=LOCALHOST, ssh=LOCALHOST, local=True) for r in range(ranks)]
        self.remote = any(not h.local for h in self.hosts)
        self.hostfile = Path(run_dir) / f"engine-{replica}-ring.json"
        self.nccl_port = 0
        self.control = ""  # rank 0's call channel over tcp, when a rank is on another machine
        self.reach = reach
        self.procs: list[StageProcess | RemoteRank] = []

    def env_of(self, rank: int) -> dict[str, str]:
        """Rank `rank`'s launcher variables over `self.env` (for a remote rank, `rank_env_only` of them)."""
        from parallm.engine.rank_group import CONTROL_ENV

        if self.backend == "nccl":
            host = self.hosts[rank]
            if self.remote:  # its GPU: its index among the ranks on its machine
                gpu, at = sum(1 for h in self.hosts[:rank] if h.ip == host.ip), self.hosts[0].ip
            else:
                gpu, at = self.replica * self.ranks + rank, LOCALHOST
            env = nccl_rank_env(self.env, rank, self.ranks, self.nccl_port, gpu=gpu, host_ip=at)
        else:
            env = rank_env(self.env, rank, self.hostfile)
        return {**env, CONTROL_ENV: self.control} if self.control else env

    def prepare(self) -> dict[str, str]:
        """Fresh addresses for the next start of the group; returns rank 0's environment."""
        if self.backend == "nccl":
            self.nccl_port = free_ports(1, self.hosts[0].ip)[0]
        else:
            write_ring_hostfile(self.hostfile, self.ranks, hosts=[h.ip for h in self.hosts],
                                remote=frozenset(h.ip for h in self.hosts if not h.local))
        if self.remote:
            calls, acks = free_ports(2, self.hosts[0].ip)
            self.control = f"tcp://{self.hosts[0].ip}:{calls},tcp://{self.hosts[0].ip}:{acks}"
        return self.env_of(0)

    def remote_start(self, rank: int) -> RankStart:
        """What a remote rank gets on stdin besides the configuration: its replica, the launcher's variables
        (not this machine's whole environment) and, on the ring backend, the ring hostfile's text."""
        env = {k: v for k, v in self.env_of(rank).items() if self.env.get(k) != v or k in RANK_DEFAULTS}
        env["PYTHONUNBUFFERED"] = "1"  # its log lines reach the supervisor as they are written
        files = {}
        if self.backend != "nccl":
            files["MLX_HOSTFILE"] = Path(env.pop("MLX_HOSTFILE")).read_text()
        return RankStart(replica=self.replica, env=env, files=files)

    def start(self, config: bytes, parent_read_fd: int, log_out: IO[str], json_logs: bool) -> None:
        """Start ranks 1..N-1 (after `prepare`, beside rank 0)."""
        self.procs = []
        for rank in range(1, self.ranks):
            spec = StageSpec("engine", replica=self.replica, env=self.env_of(rank))
            host = self.hosts[rank]
            proc = StageProcess(spec) if host.local else RemoteRank(spec, host, self.remote_start(rank), self.reach)
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
