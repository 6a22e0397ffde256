"""Tensor-parallel ranks on other machines (launch/remote_rank.py, launch/group.py): the hostfile's
placement and its refusals, the ssh command lines, what a remote rank reads on stdin, rank 0's call
channel over tcp:// with CURVE, and the failure paths that need no second machine (an unreachable
host, a missing model, the supervisor's end of stdin closing). No test here reaches another machine:
there is no ssh server on the CI host (docs/operations.md says what was not run)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from parallm.config import Config
from parallm.engine import distributed
from parallm.engine.distributed import CONTROL_ENV, Leader, TensorParallelError, follow
from parallm.keys import Curve
from parallm.launch.group import Followers, HostfileError, hostfile_ranks, place_ranks
from parallm.launch.process import StageSpec
from parallm.launch.remote_rank import RankHost, RemoteRank, read_payload, ssh_argv, write_payload
from parallm.transport import set_curve, stop_authenticators
from tests._engine_helpers import greedy, make_engine, req, run_all, tiny_model

ROOT = Path(__file__).resolve().parents[1]
UNROUTED = "192.0.2.7"  # TEST-NET-1: never an address of this machine


def hostfile(tmp_path: Path, entries: list[dict]) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(entries))
    return str(path)


def config_with(**sections) -> Config:
    config = Config()
    return msgspec.structs.replace(config, **{name: msgspec.structs.replace(getattr(config, name), **fields)
                                              for name, fields in sections.items()})


def test_the_hostfile_places_ranks_here_and_on_other_machines(tmp_path):
    path = hostfile(tmp_path, [{"ssh": "localhost"}, {"ssh": "gpu2", "ips": [UNROUTED], "python": "/opt/py/bin/python",
                                                      "cwd": "/srv/parallm"}])
    here, there = hostfile_ranks(path, 2)
    assert here == RankHost(rank=0, ip="127.0.0.1", ssh="localhost", local=True)
    assert there == RankHost(rank=1, ip=UNROUTED, ssh="gpu2", local=False, python="/opt/py/bin/python",
                             cwd="/srv/parallm")
    assert [h.local for h in hostfile_ranks(hostfile(tmp_path, [{"ssh": "localhost"}] * 2), 2)] == [True, True]
    mlx_form = tmp_path / "mlx.json"  # mlx.launch's {"backend", "envs", "hosts"} form
    mlx_form.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": "localhost"}, {"ssh": "localhost"}]}))
    assert len(hostfile_ranks(str(mlx_form), 2)) == 2
    with pytest.raises(HostfileError, match="rank 0 is on 192.0.2.7, not an address of this machine"):
        hostfile_ranks(hostfile(tmp_path, [{"ssh": "gpu2", "ips": [UNROUTED]}, {"ssh": "localhost"}]), 2)
    with pytest.raises(HostfileError, match="names 2 rank"):
        hostfile_ranks(path, 3)
    with pytest.raises(HostfileError, match="not MLX's hostfile"):
        hostfile_ranks(hostfile(tmp_path, [{"port": 1}]), 1)


def test_ranks_on_other_machines_need_curve_one_replica_and_a_reachable_host(tmp_path):
    # ssh goes to 127.0.0.1, where no ssh server listens: refused at once, by the real ssh client
    path = hostfile(tmp_path, [{"ssh": "localhost"}, {"ssh": "127.0.0.1", "ips": [UNROUTED]}])
    with pytest.raises(HostfileError, match="rank 1 on 127.0.0.1: ranks on other machines need --transport.kind tcp"):
        place_ranks(config_with(engine={"hostfile": path, "tensor_parallel": 2}), 2)
    keys = ["k"] * 4
    with pytest.raises(HostfileError, match=r"serve one engine replica \(engine.replicas=1"):
        place_ranks(config_with(engine={"hostfile": path, "tensor_parallel": 2, "replicas": 2},
                                transport={"kind": "tcp", "curve_keys": keys}), 2)
    with pytest.raises(HostfileError, match="cannot reach rank 1's host '127.0.0.1' over ssh"):
        place_ranks(config_with(engine={"hostfile": path, "tensor_parallel": 2},
                                transport={"kind": "tcp", "curve_keys": keys}, model={"path": str(tmp_path)}), 2)
    local = hostfile(tmp_path, [{"ssh": "localhost"}, {"ssh": "127.0.0.1"}])  # this machine: no ssh, no check
    assert len(place_ranks(config_with(engine={"hostfile": local, "tensor_parallel": 2}), 2)) == 2


def test_a_remote_rank_is_started_over_ssh_with_its_payload_on_stdin(tmp_path):
    host = RankHost(rank=1, ip=UNROUTED, ssh="gpu2", local=False, python="/opt/py/bin/python", cwd="/srv/my dir")
    argv = ssh_argv(host)
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and "ServerAliveInterval=5" in argv and argv[-2] == "gpu2"
    assert argv[-1] == "cd '/srv/my dir' && exec /opt/py/bin/python -m parallm.launch.remote_rank"
    hosts = [RankHost(rank=0, ip="127.0.0.1", ssh="localhost", local=True), host]
    group = Followers(2, 0, {"PATH": "/usr/bin", "LD_PRELOAD": "here-only.so"}, tmp_path, "ring", hosts=hosts)
    rank0 = group.prepare()
    calls, acks = rank0[CONTROL_ENV].split(",")
    assert calls.startswith("tcp://127.0.0.1:") and acks.startswith("tcp://127.0.0.1:") and calls != acks
    start = group.remote_start(1)
    assert start.replica == 0 and start.env == {"MLX_RANK": "1", CONTROL_ENV: rank0[CONTROL_ENV],
                                                "PYTHONUNBUFFERED": "1"}
    ring = json.loads(start.files["MLX_HOSTFILE"])  # the ring hostfile's text, not this machine's path
    assert ring[0][0].startswith("127.0.0.1:") and ring[1][0].startswith(f"{UNROUTED}:")
    buffer = io.BytesIO()
    write_payload(buffer, start, b"\x00config\xff")
    buffer.seek(0)
    assert read_payload(buffer) == (start, b"\x00config\xff")
    nccl = Followers(2, 0, {}, tmp_path, "nccl", hosts=hosts)
    nccl.prepare()
    env = nccl.remote_start(1).env
    assert env["NCCL_HOST_IP"] == "127.0.0.1" and env["CUDA_VISIBLE_DEVICES"] == "0" and env["MLX_WORLD_SIZE"] == "2"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["MLX_USE_CUDA_GRAPHS"] == "0"  # graphs cost NCCL's launches ~3x
    assert nccl.remote_start(1).files == {}
    assert nccl.env_of(0)["MLX_USE_CUDA_GRAPHS"] == "0"  # rank 0 too: the group's steps go at the slowest rank's pace
    chosen = Followers(2, 0, {"MLX_USE_CUDA_GRAPHS": "1", "NCCL_NVLS_ENABLE": "1"}, tmp_path, "nccl", hosts=hosts)
    chosen.prepare()
    env = chosen.remote_start(1).env  # the user's settings win, and reach a rank on another machine too
    assert env["MLX_USE_CUDA_GRAPHS"] == "1" and env["NCCL_NVLS_ENABLE"] == "1"
    assert "MLX_USE_CUDA_GRAPHS" not in Followers(2, 0, {}, tmp_path, "ring", hosts=hosts).prepare()


def local_entry(host: RankHost) -> list[str]:
    """The remote entry run here without ssh (there is no ssh server on this host)."""
    return [sys.executable, "-m", "parallm.launch.remote_rank"]


def remote_rank(tmp_path: Path, model_path: str) -> RemoteRank:
    hosts = [RankHost(rank=0, ip="127.0.0.1", ssh="localhost", local=True),
             RankHost(rank=1, ip="127.0.0.1", ssh="gpu2", local=False)]
    group = Followers(2, 0, dict(os.environ), tmp_path, "ring", hosts=hosts)
    group.prepare()
    rank = RemoteRank(StageSpec("engine", env=group.env_of(1)), hosts[1], group.remote_start(1), argv=local_entry)
    log = open(tmp_path / "rank.log", "w")
    rank.start(config_with(model={"path": model_path}).encode(), -1, log, False)
    return rank


def test_a_remote_rank_without_the_model_exits_saying_so(tmp_path):
    rank = remote_rank(tmp_path, str(tmp_path / "absent-model"))
    rank.proc.wait(timeout=60)
    assert rank.exit_code() == 2 and not rank.alive()
    assert "absent-model' does not exist on this machine; copy it there" in (tmp_path / "rank.log").read_text()


def test_a_remote_rank_ends_when_the_supervisor_side_closes(tmp_path):
    rank = remote_rank(tmp_path, str(tmp_path))  # joins the ring and waits there for rank 0, which never comes
    time.sleep(1.5)
    assert rank.alive(), (tmp_path / "rank.log").read_text()
    t0 = time.monotonic()
    rank.terminate(timeout=30)  # closes its stdin, as the supervisor's death or a dropped connection does
    assert not rank.alive() and time.monotonic() - t0 < 10


class RankOf:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def curve_keys():
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    keys = Curve(server_public=server_public, server_secret=server_secret, public=public, secret=secret,
                 allowed=frozenset([public]))
    set_curve(keys)
    yield keys
    set_curve(None)
    stop_authenticators()


def tcp_channel() -> tuple[str, str]:
    from parallm.launch.group import free_ports

    calls, acks = free_ports(2)
    return f"tcp://127.0.0.1:{calls}", f"tcp://127.0.0.1:{acks}"


def test_rank_0s_calls_over_tcp_with_curve_keep_a_follower_in_step(curve_keys):
    addresses = tcp_channel()
    follower = make_engine(tiny_model("llama"))
    result: list = []
    thread = threading.Thread(target=lambda: result.append(follow(follower, RankOf(1), addresses)), daemon=True)
    thread.start()
    leader = Leader(make_engine(tiny_model("llama")), RankOf(0), addresses)
    work = [req(f"r{i}", [i + 1, 7, 9, 11], greedy(6)) for i in range(3)]
    got = run_all(leader, work)
    deadline = time.monotonic() + 10
    while (state := leader.stats().ranks[1]).step < leader._engine.steps and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.agrees and state.step == leader._engine.steps
    leader.close()
    thread.join(30)
    assert result == [0]
    assert {k: d["tokens"] for k, d in got.items()} == \
        {k: d["tokens"] for k, d in run_all(make_engine(tiny_model("llama")), work).items()}


def test_a_peer_without_the_keys_cannot_follow_rank_0(curve_keys, monkeypatch):
    monkeypatch.setattr(distributed, "CONNECT_WAIT_S", 1)
    addresses = tcp_channel()
    stranger = zmq.Context.instance().socket(zmq.SUB)  # no CURVE keys: the handshake fails, no subscription
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.connect(addresses[0])
    try:
        with pytest.raises(TensorParallelError, match="did not connect"):
            Leader(make_engine(tiny_model("llama")), RankOf(0), addresses)
    finally:
        stranger.close(0)


WORK = [([5, 9, 14, 3], 10), ([7, 7, 8, 21, 30, 2, 4], 12), ([11, 40], 8)]


def rank_0_main(config_file: str, out: str) -> int:
    """Rank 0 as the engine stage builds it (stages/engine.py main), serving WORK through the Leader."""
    from parallm.engine import Engine, EngineModel
    from parallm.keys import stage_curve
    from parallm.models import load_model

    config = Config.decode(Path(config_file).read_bytes())
    set_curve(stage_curve(config.transport.curve_keys))
    group = distributed.join(2, "ring")
    loaded = load_model(config.model)
    distributed.shard_model(loaded.model, group)
    config = distributed.agreed_config(config, group)
    engine = Engine(EngineModel.of(loaded), config)
    distributed.freeze_clock(engine)
    engine.warm_up()
    leader = distributed.lead(engine, loaded.model, group, distributed.control_addresses(config.transport.run_dir, 0))
    got = run_all(leader, [req(f"w{i}", ids, greedy(n)) for i, (ids, n) in enumerate(WORK)])
    leader.close()
    Path(out).write_text(json.dumps({f"{rid}/{index}": d["tokens"] for (rid, index), d in sorted(got.items())}))
    return 0


@pytest.mark.slow
def test_a_rank_started_through_the_remote_entry_serves_with_rank_0(tmp_path):
    """Rank 1 goes the whole remote way but for ssh (its payload on stdin, the ring hostfile as text, the
    calls over tcp with CURVE, parallm.launch.remote_rank's follower); its tokens are the one engine's."""
    from parallm.engine import Engine, EngineModel
    from parallm.models import load_model
    from tests.e2e.test_parallel import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "tiny-llama")
    keys = [k.decode() for pair in (zmq.curve_keypair(), zmq.curve_keypair()) for k in pair]
    config = config_with(model={"path": str(model_dir)}, engine={"tensor_parallel": 2},
                         transport={"kind": "tcp", "curve_keys": keys, "run_dir": str(tmp_path)})
    (tmp_path / "config.bin").write_bytes(config.encode())
    hosts = [RankHost(rank=0, ip="127.0.0.1", ssh="localhost", local=True),
             RankHost(rank=1, ip="127.0.0.1", ssh="gpu2", local=False)]
    group = Followers(2, 0, dict(os.environ), tmp_path, "ring", hosts=hosts, reach=local_entry)
    env = {**group.prepare(), "PYTHONPATH": str(ROOT)}
    rank0 = subprocess.Popen([sys.executable, __file__, str(tmp_path / "config.bin"), str(tmp_path / "out.json")],
                             env=env, cwd=ROOT)
    with open(tmp_path / "rank1.log", "w") as log:
        group.start(config.encode(), -1, log, False)
        try:
            assert rank0.wait(timeout=300) == 0
            group.procs[0].proc.wait(timeout=60)
            assert group.exit_code(1) == 0, (tmp_path / "rank1.log").read_text()
        finally:
            rank0.kill()
            group.terminate(5)
    one = Engine(EngineModel.of(load_model(config.model)), config_with(model={"path": str(model_dir)}))
    want = run_all(one, [req(f"w{i}", ids, greedy(n)) for i, (ids, n) in enumerate(WORK)])
    assert [len(want[(f"w{i}", 0)]["tokens"]) for i in range(len(WORK))] == [n for _, n in WORK]
    assert json.loads((tmp_path / "out.json").read_text()) == \
        {f"{rid}/{index}": d["tokens"] for (rid, index), d in sorted(want.items())}


def test_the_control_channel_comes_from_the_launchers_environment(tmp_path, monkeypatch):
    assert distributed.control_addresses(str(tmp_path), 1)[0] == f"ipc://{tmp_path}/engine-1-calls.sock"
    monkeypatch.setenv(CONTROL_ENV, "tcp://10.0.0.1:5000,tcp://10.0.0.1:5001")
    assert distributed.control_addresses(str(tmp_path), 1) == ("tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001")
    monkeypatch.setenv(CONTROL_ENV, "ipc:///x")
    with pytest.raises(TensorParallelError, match="is not two tcp:// addresses"):
        distributed.control_addresses(str(tmp_path), 1)


if __name__ == "__main__":
    sys.exit(rank_0_main(sys.argv[1], sys.argv[2]))
