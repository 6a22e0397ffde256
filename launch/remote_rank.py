"""Tensor-parallel ranks on other machines, started over ssh as `mlx.launch` starts them.

engine.hostfile (MLX's hostfile: one {"ssh": HOST, "ips": [ADDRESS]} entry per rank, rank 0 first)
may put ranks 1..N-1 on other machines; rank 0 is the engine stage of this server, so its entry must
be this machine. For each start of the group the supervisor runs, for every remote rank,

    ssh -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=5 -o ServerAliveCountMax=3 HOST \
        'cd CWD && exec PYTHON -m parallm.launch.remote_rank'

(CWD and PYTHON: the entry's optional "cwd" and "python", else this process's working directory and
interpreter, as `mlx.launch` defaults them) and writes on ssh's stdin what that rank needs, never on
the command line or a file: a length-prefixed RankStart message (parallm/protocol/to_ranks.py: the
replica, MLX's and NCCL's environment for the rank, and MLX's ring hostfile as text) and the encoded configuration, which holds the CURVE
keys and API keys. stdin then stays open: its end (the supervisor, or the ssh connection, gone) ends
the rank, like a local stage's parent pipe.

The remote side (`main`) checks that the model directory the configuration names exists there (the
supervisor also checks it over ssh before the first start: `check_hosts`), writes the ring hostfile
to a temporary file, sets the environment and runs the engine stage's follower
(parallm/engine/distributed.py), whose call channel to rank 0 is tcp:// with CURVE.

A rank that cannot be reached (ssh exits 255 after ConnectTimeout), dies, or whose connection drops
(ssh gives up after 3 unanswered keep-alives, ~15 s) ends its ssh process; the supervisor sees that
process exit as the rank's death and restarts the whole group, as for a local rank.
"""

from __future__ import annotations

import os
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import IO, BinaryIO, Callable, Sequence

from parallm import protocol
from parallm.protocol import RankStart

from .process import ChildProcess, StageSpec, _pump

CONNECT_TIMEOUT_S = 10
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3")
ENTRY = ("-m", "parallm.launch.remote_rank")
_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class RankHost:
    """Where one rank runs (an engine.hostfile entry): `ip` for the ring / NCCL / call channel, `ssh` to
    start it, and for a remote one the interpreter and directory to run it with."""

    rank: int
    ip: str
    ssh: str
    local: bool
    python: str = ""
    cwd: str = ""


def ssh_argv(host: RankHost) -> list[str]:
    """The command that starts rank `host.rank` on its machine (it then reads its payload on stdin)."""
    python = host.python or sys.executable
    cwd = host.cwd or os.getcwd()
    remote = f"cd {shlex.quote(cwd)} && exec {shlex.join([python, *ENTRY])}"
    return ["ssh", *SSH_OPTIONS, host.ssh, remote]


def write_payload(out: BinaryIO, start: RankStart, config: bytes) -> None:
    """What a remote rank reads on stdin: its RankStart, then the encoded configuration."""
    head = protocol.encode(start)
    out.write(_LENGTH.pack(len(head)) + head + _LENGTH.pack(len(config)) + config)
    out.flush()


def read_payload(stream: BinaryIO) -> tuple[RankStart, bytes]:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = stream.read(n - len(data))
            if not chunk:
                raise EOFError("the supervisor closed stdin before the rank's payload was complete")
            data += chunk
        return data

    start = protocol.decode(exactly(_LENGTH.unpack(exactly(_LENGTH.size))[0]), RankStart)
    return start, exactly(_LENGTH.unpack(exactly(_LENGTH.size))[0])


class RemoteRank(ChildProcess):
    """A rank on another machine as the supervisor holds it: its ssh process (the same interface as a
    local StageProcess for the group: start, alive, exit_code, kill, terminate)."""

    def __init__(self, spec: StageSpec, host: RankHost, start: RankStart,
                 argv: Callable[[RankHost], list[str]] = ssh_argv) -> None:
        """`argv`: the command that reaches the host (ssh; a test runs the same entry without it)."""
        self.spec = spec
        self.host = host
        self.start_message = start
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.pid = 0

    def start(self, config: bytes, parent_read_fd: int, log_out: IO[str], json_logs: bool) -> None:
        # stdin is the rank's lifeline: the supervisor keeps it open (and its death closes it)
        self.proc = subprocess.Popen(self.argv(self.host), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        stdin = self.proc.stdin
        threading.Thread(target=self._send, args=(stdin, config), daemon=True,
                         name=f"payload-rank{self.host.rank}").start()
        label = f"{self.spec.label}-rank{self.host.rank}@{self.host.ssh}"
        threading.Thread(target=_pump, args=(self.proc.stdout, label, log_out, json_logs), daemon=True,
                         name=f"log-{label}").start()

    def _send(self, stdin: BinaryIO, config: bytes) -> None:
        try:
            write_payload(stdin, self.start_message, config)
        except OSError:  # ssh exited first (unreachable host): its exit is the rank's death
            pass

    def kill(self) -> None:
        """End the ssh process: the connection closes, the remote rank reads the end of stdin and exits."""
        super().kill()
        self._close_stdin()

    def terminate(self, timeout: float) -> None:
        if self.alive():
            self._close_stdin()  # the rank exits on its own once its stdin ends
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


class HostCheckError(RuntimeError):
    """A remote rank's machine cannot be reached over ssh, or lacks the model."""


def check_hosts(hosts: Sequence[RankHost], model_path: str) -> None:
    """Before the first start: every remote host answers over ssh and has `model_path` (the same
    directory as here: the ranks load the model themselves). Raises HostCheckError naming the host."""
    for host in hosts:
        if host.local:
            continue
        argv = ["ssh", *SSH_OPTIONS, host.ssh, f"test -e {shlex.quote(model_path)} && echo present || echo absent"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CONNECT_TIMEOUT_S + 20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HostCheckError(f"cannot reach rank {host.rank}'s host {host.ssh!r} over ssh: {exc}") from None
        answer = done.stdout.strip()
        if done.returncode != 0 or answer not in ("present", "absent"):
            why = (done.stderr.strip().splitlines() or [f"ssh exited with {done.returncode}"])[-1]
            raise HostCheckError(f"cannot reach rank {host.rank}'s host {host.ssh!r} over ssh ({why}); ranks on "
                                 "other machines need key-based ssh to them (BatchMode: no password prompt)")
        if answer == "absent":
            raise HostCheckError(f"the model directory {model_path!r} does not exist on {host.ssh!r} (rank "
                                 f"{host.rank}): every rank loads the model itself, so copy it there at the same path")


# ------------------------------------------------------------------ the remote side

def watch_stdin() -> None:
    """End this process when its stdin ends (the supervisor, its ssh client or the connection gone). A
    forked watcher does it, not a thread: this process may wait inside an MLX collective (joining the
    ring, an all-sum) without releasing the interpreter lock, and a thread would never run."""
    rank = os.getpid()
    if os.fork() != 0:
        return
    os.close(1)  # the watcher must not hold ssh's output channels open after the rank exits
    os.close(2)
    try:
        while os.read(0, 1 << 16):
            pass
    except OSError:
        pass
    if os.getppid() == rank:  # still its child: the rank is alive (else its pid may be another's now)
        os.kill(rank, signal.SIGKILL)
    os._exit(0)


def main() -> int:
    """On the rank's machine: read the payload on stdin, check the model, join the group, follow rank 0."""
    start, config_bytes = read_payload(sys.stdin.buffer)
    os.environ.update(start.env)  # before MLX is imported (CUDA_VISIBLE_DEVICES)
    from parallm.config import Config

    config = Config.decode(config_bytes)
    if not os.path.exists(config.model.path):
        print(f"rank {start.env.get('MLX_RANK')}: the model directory {config.model.path!r} does not exist on "
              "this machine; copy it there at the same path", file=sys.stderr, flush=True)
        return 2
    for name, text in start.files.items():
        fd, path = tempfile.mkstemp(prefix="parallm-rank-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.environ[name] = path
    from parallm.keys import stage_curve
    from parallm.logs import setup_logging
    from parallm.transport import set_curve

    watch_stdin()
    setup_logging(config.log_level, "engine", config.log_format)
    set_curve(stage_curve(config.transport.curve_keys))
    from parallm.engine import distributed

    return distributed.follower_main(config, start.replica)


if __name__ == "__main__":
    sys.exit(main())
