"""CURVE on tcp:// sockets (parallm/keys.py, parallm/transport.py): an allowed key gets through, any
other peer's frames never reach the stage; key files and the supervisor's keys."""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from parallm import keys, protocol
from parallm.transport import Receiver, Sender, open_socket, stop_authenticators


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def key_files(tmp_path):
    keys.main(["new", str(tmp_path / "allowed"), "client"])
    keys.main(["new", str(tmp_path / "other"), "intruder"])
    return tmp_path


def test_only_allowed_client_keys_reach_a_bound_tcp_socket(key_files, tmp_path):
    server_keys = keys.stage_curve(keys.supervisor_keys("", str(key_files / "allowed"), str(tmp_path)))
    allowed = keys.client_curve(tmp_path / keys.SERVER_PUBLIC_FILE, key_files / "allowed" / "client.key_secret")
    intruder = keys.client_curve(tmp_path / keys.SERVER_PUBLIC_FILE, key_files / "other" / "intruder.key_secret")
    address = f"tcp://127.0.0.1:{_port()}"
    ctx = zmq.Context()
    try:
        inbox = Receiver(open_socket(ctx, zmq.PULL, address, bind=True, curve=server_keys), protocol.EngineInbound)
        senders = {who: Sender(open_socket(ctx, zmq.PUSH, address, bind=False, curve=curve))
                   for who, curve in (("plain", None), ("intruder", intruder), ("allowed", allowed))}
        for who, sender in senders.items():
            sender.send(protocol.Abort(rids=[who]), block=False)
        got = inbox.recv(timeout_ms=5000)
        assert isinstance(got, protocol.Abort) and got.rids == ["allowed"]
        assert inbox.recv(timeout_ms=500) is None
        stage = Sender(open_socket(ctx, zmq.PUSH, address, bind=False, curve=server_keys))  # the stages' own pair
        stage.send(protocol.Abort(rids=["stage"]))
        assert inbox.recv(timeout_ms=5000).rids == ["stage"]
        for s in (*senders.values(), stage, inbox):
            s.close()
    finally:
        stop_authenticators()
        ctx.term()


def test_ipc_sockets_need_no_keys(tmp_path):
    server_keys = keys.stage_curve(keys.supervisor_keys("", "", str(tmp_path)))
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/x.sock"
    inbox = Receiver(open_socket(ctx, zmq.PULL, address, bind=True, curve=server_keys), protocol.EngineInbound)
    out = Sender(open_socket(ctx, zmq.PUSH, address, bind=False))
    out.send(protocol.Abort(rids=["a"]))
    assert inbox.recv(timeout_ms=5000).rids == ["a"]
    ctx.destroy(0)


def test_key_files(key_files, tmp_path):
    public, secret = keys.load_pair(key_files / "allowed" / "client.key")  # NAME.key means its secret twin
    assert keys.load_public(key_files / "allowed" / "client.key") == public and len(secret) == 40
    assert keys.load_allowed(key_files / "allowed") == {public}
    with pytest.raises(keys.CurveKeyError, match="not a directory"):
        keys.load_allowed(tmp_path / "missing")
    with pytest.raises(keys.CurveKeyError, match="cannot read"):
        keys.load_public(tmp_path / "missing.key")
    (tmp_path / "lone.key").write_bytes((key_files / "allowed" / "client.key").read_bytes())
    with pytest.raises(keys.CurveKeyError, match="no secret key"):
        keys.load_pair(tmp_path / "lone.key")


def test_the_supervisor_loads_or_makes_the_server_pair(key_files, tmp_path):
    made = keys.supervisor_keys("", "", str(tmp_path))
    assert keys.load_public(tmp_path / keys.SERVER_PUBLIC_FILE) == made[0].encode()
    assert (tmp_path / keys.SERVER_PUBLIC_FILE).stat().st_mode & 0o077 == 0
    given = keys.supervisor_keys(str(key_files / "allowed" / "client.key_secret"), str(key_files / "other"), "")
    public, secret = keys.load_pair(key_files / "allowed" / "client.key_secret")
    curve = keys.stage_curve(given)
    assert (curve.server_public, curve.server_secret) == (public, secret)
    assert keys.load_public(key_files / "other" / "intruder.key") in curve.allowed and curve.public in curve.allowed
    assert keys.stage_curve([]) is None
    with pytest.raises(keys.CurveKeyError):
        keys.stage_curve(["x"])


def test_client_keys_come_in_pairs(key_files):
    from parallm.client import AsyncClient

    with pytest.raises(ValueError, match="both"):
        AsyncClient("tcp://127.0.0.1:1", server_key=str(key_files / "allowed" / "client.key"))


def test_the_adapter_publisher_reaches_the_engine_only_with_an_allowed_key_file(key_files, tmp_path):
    """parallm.training.AdapterPublisher(server_key=, client_key=): the trainer side of issue 22's
    planted-adapter attack (tests/e2e/test_curve.py makes the attack itself)."""
    from parallm.training.publisher import AdapterPublisher

    server_keys = keys.stage_curve(keys.supervisor_keys("", str(key_files / "allowed"), str(tmp_path)))
    server_public = str(tmp_path / keys.SERVER_PUBLIC_FILE)
    address = f"tcp://127.0.0.1:{_port()}"
    ctx = zmq.Context()
    try:
        sub = open_socket(ctx, zmq.SUB, address, bind=True, curve=server_keys)  # the engine's adapters socket
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        inbox = Receiver(sub, protocol.EngineInbound)
        publishers = {who: AdapterPublisher(address, ctx=ctx, settle_s=0, server_key=server_public,
                                            client_key=str(key_files / folder / f"{who}.key_secret"))
                      for who, folder in (("intruder", "other"), ("client", "allowed"))}
        names: set[str] = set()
        deadline = time.monotonic() + 10
        while "client" not in names and time.monotonic() < deadline:
            for who, publisher in publishers.items():  # PUB drops what it sends before the handshake: resend
                publisher.publish(who, weights=b"w")
            got = inbox.recv(timeout_ms=100)
            names |= {got.name} if isinstance(got, protocol.AdapterPublish) else set()
        while (got := inbox.recv(timeout_ms=300)) is not None:
            names.add(got.name)
        assert names == {"client"}
    finally:
        stop_authenticators()
        ctx.destroy(0)


def test_parallm_train_takes_the_key_files_in_pairs(key_files, tmp_path, capsys, monkeypatch):
    """parallm-train --server.curve-server-key F --server.curve-client-key F.key_secret: both or
    neither, and a key file it cannot read stops it with the file named (before any socket)."""
    from parallm.training import cli

    monkeypatch.setenv("PARALLM_NO_OPENBLAS", "1")  # main() would re-exec this process with OpenBLAS
    router = ["--router", "tcp://127.0.0.1:1"]
    with pytest.raises(SystemExit):
        cli.parse([*router, "--server.curve-server-key", str(key_files / "allowed" / "client.key")])
    assert "give both" in capsys.readouterr().err
    missing = str(tmp_path / "nowhere.key")
    assert cli.main([*router, "--server.curve-server-key", missing,
                     "--server.curve-client-key", str(key_files / "allowed" / "client.key_secret")]) == 2
    assert "nowhere.key" in capsys.readouterr().err
