"""Over tcp:// only allowed CURVE keys reach the server (issue 22): a local process without one cannot
publish or unload adapters, pause, abort, plant a trainer's status, subscribe to rollouts, reach the
tokenizer or forge heartbeats.

Each attack is also made with an allowed key through the same raw sockets, so that the test shows
the attack would work without CURVE (as it did before it)."""

from __future__ import annotations

import socket
import time
import uuid

import msgspec
import pytest
import zmq

from parallm import keys, protocol
from parallm.client import Client, StageFailure
from parallm.protocol import SamplingParams
from parallm.launch.local import free_port_range

from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 27 s with its CURVE server: make test's 10-minute budget (clean clone, 2-core CI host)


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    keys.main(["new", str(d / "allowed"), "trainer"])
    keys.main(["new", str(d / "other"), "intruder"])
    return d


@pytest.fixture(scope="module")
def tcp(key_dir):
    base = free_port_range()
    with Server("--transport.kind", "tcp", "--transport.tcp-base-port", str(base),
                "--transport.curve-clients", str(key_dir / "allowed"),
                "--supervisor.restart-backoff-s", "0.2", "--pooling-model", "minilm=default") as srv:
        srv.base = base
        srv.tcp_router = f"tcp://127.0.0.1:{base + 2}"
        srv.server_key = f"{srv.run_dir}/{keys.SERVER_PUBLIC_FILE}"
        srv.curve = keys.client_curve(srv.server_key, key_dir / "allowed" / "trainer.key_secret")
        srv.client = Client(srv.tcp_router, timeout=60, server_key=srv.server_key,
                            client_key=str(key_dir / "allowed" / "trainer.key_secret"))
        try:
            yield srv
        finally:
            srv.client.close()


def _socket(ctx: zmq.Context, kind: int, address: str, curve: keys.Curve | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    sock.connect(address)
    return sock


def _addr(srv, name: str) -> str:
    return srv.client._client.welcome.addresses[name]


def test_only_allowed_keys_get_a_welcome(tcp, key_dir):
    with pytest.raises(StageFailure, match="no Welcome"):
        Client(tcp.tcp_router, timeout=1.5)
    with pytest.raises(StageFailure, match="no Welcome"):
        Client(tcp.tcp_router, timeout=1.5, server_key=tcp.server_key,
               client_key=str(key_dir / "other" / "intruder.key_secret"))
    assert tcp.client.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].finish_reason == "length"
    assert len(tcp.client.pool(["pooling travels the same CURVE socket"], "minilm")[0]) == 384
    assert f"CURVE server key {tcp.server_key}" in "\n".join(tcp.lines)  # the ready line tells clients where it is


def _publish(srv, curve: keys.Curve | None, name: str) -> None:
    from parallm.adapters import save_bytes
    import mlx.core as mx

    loaded = srv.client.list_adapters()
    assert not loaded.adapters, "the test expects no adapter yet"
    # a real adapter for the default model: rank 1 on layer 0's q_proj
    hidden = 576
    weights = {"model.layers.0.self_attn.q_proj.lora_a": mx.zeros((hidden, 1)),
               "model.layers.0.self_attn.q_proj.lora_b": mx.zeros((1, hidden))}
    config = {"fine_tune_type": "lora", "num_layers": 30,
              "lora_parameters": {"rank": 1, "scale": 1.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]}}
    ctx = zmq.Context()
    try:
        pub = _socket(ctx, zmq.PUB, _addr(srv, "adapters"), curve)
        time.sleep(0.5)  # the SUB side learns of the new publisher
        pub.send(protocol.encode(protocol.AdapterPublish(name=name, config=config, weights=save_bytes(weights))))
        pub.close()
    finally:
        ctx.term()


def _adapter_names(srv) -> set[str]:
    return {a.name for a in srv.client.list_adapters().adapters}


def test_a_publisher_without_an_allowed_key_loads_no_adapter(tcp):
    _publish(tcp, None, "planted")
    time.sleep(1.5)
    assert "planted" not in _adapter_names(tcp)
    _publish(tcp, tcp.curve, "allowed")  # the same message with an allowed key loads
    deadline = time.monotonic() + 20
    while "allowed" not in _adapter_names(tcp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "allowed" in _adapter_names(tcp)
    _push(tcp, _addr(tcp, "engine"), protocol.AdapterUnload(name="allowed"), None)  # the unload attack
    assert "allowed" in _adapter_names(tcp)
    _push(tcp, _addr(tcp, "engine"), protocol.AdapterUnload(name="allowed"), tcp.curve)
    assert "allowed" not in _adapter_names(tcp)


def _push(srv, address: str, message, curve: keys.Curve | None) -> None:
    ctx = zmq.Context()
    try:
        sock = _socket(ctx, zmq.PUSH, address, curve)
        sock.send(protocol.encode(message))
        time.sleep(0.5)
        sock.close()
    finally:
        ctx.term()


def test_pause_resume_and_abort_without_an_allowed_key_do_nothing(tcp):
    engine = _addr(tcp, "engine")
    _push(tcp, engine, protocol.Pause(mode="abort"), None)
    assert not tcp.client.stats("engine").paused
    assert tcp.client.pause().paused  # an allowed key pauses; the request below waits
    rid = tcp.client.submit([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    _push(tcp, engine, protocol.Abort(all=True), None)
    _push(tcp, engine, protocol.Resume(), None)
    assert tcp.client.stats("engine").paused
    assert not tcp.client.resume().paused
    results = tcp.client.result(rid)
    assert [r.finish_reason for r in results] == ["length"] and len(results[0].token_ids) == 8


def test_a_trainer_status_without_an_allowed_key_is_not_shown(tcp):
    """The planted trainer: a TrainingStatus pushed to ingress' training socket shows in
    /v1/training/status only when it came with an allowed key."""
    import httpx

    for who, curve in (("planted", None), ("allowed", tcp.curve)):
        _push(tcp, _addr(tcp, "training"), protocol.TrainingStatus(trainer=who, adapter="pol", step=7), curve)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        shown = {t["trainer"] for t in httpx.get(f"{tcp.url}/v1/training/status", timeout=10).json()["trainers"]}
        if "allowed" in shown:
            break
        time.sleep(0.2)
    assert shown == {"allowed"}


def test_rollouts_reach_only_allowed_subscribers(tcp):
    ctx = zmq.Context()
    try:
        subs = {}
        for who, curve in (("intruder", None), ("trainer", tcp.curve)):
            subs[who] = _socket(ctx, zmq.SUB, _addr(tcp, "rollouts"), curve)
            subs[who].setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.5)
        tcp.client.generate([5, 6, 7], SamplingParams(max_tokens=2))
        assert subs["trainer"].poll(10_000), "an allowed subscriber gets the rollout"
        assert not subs["intruder"].poll(500)
    finally:
        ctx.destroy(linger=0)


def test_the_tokenizer_reads_nothing_from_a_peer_without_an_allowed_key(tcp):
    """The eavesdropper's route: Detokenize other users' token ids through the tokenizer's socket."""
    ctx = zmq.Context()
    try:
        identity = f"raw-{uuid.uuid4().hex[:8]}".encode()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, identity)
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = (
            tcp.curve.server_public, tcp.curve.public, tcp.curve.secret)
        dealer.connect(tcp.tcp_router)
        dealer.send(protocol.encode(protocol.Hello(client=identity.decode())))
        assert dealer.poll(10_000)
        assert isinstance(protocol.decode(dealer.recv()), protocol.Welcome)
        tokenizer = _addr(tcp, "tokenizers").split(",")[0]
        ask = protocol.Tokenize(qid="q-intruder", reply_to=identity, prompt="hello")
        _push(tcp, tokenizer, ask, None)
        assert not dealer.poll(1000), "the tokenizer answered a peer without an allowed key"
        _push(tcp, tokenizer, msgspec.structs.replace(ask, qid="q-allowed"), tcp.curve)
        assert dealer.poll(10_000)
        reply = protocol.decode(dealer.recv())
        assert reply.qid == "q-allowed"
    finally:
        ctx.destroy(linger=0)


def test_heartbeats_and_control_are_never_on_an_open_tcp_port(tcp):
    """The supervisor's inbox is an ipc socket in the private run dir: nothing listens on its tcp port."""
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", tcp.base + 3), timeout=2).close()


def test_the_control_channel_reaches_only_allowed_subscribers(tcp):
    """The supervisor's control PUB (StageDown/StageUp, Drain) is on tcp like the others, so it is a
    CURVE server too: a subscriber without an allowed key hears nothing of a stage's restart.
    (Last in the module: it restarts the tokenizer.)"""
    import os
    import signal

    ctx = zmq.Context()
    try:
        subs = {}
        for who, curve in (("intruder", None), ("trainer", tcp.curve)):
            subs[who] = _socket(ctx, zmq.SUB, _addr(tcp, "control"), curve)
            subs[who].setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.5)
        os.kill(tcp.stage_pids()["tokenizer-0"], signal.SIGKILL)
        heard, deadline = [], time.monotonic() + 30
        while not any(isinstance(m, protocol.StageUp) for m in heard) and time.monotonic() < deadline:
            if subs["trainer"].poll(500):
                heard.append(protocol.decode(subs["trainer"].recv()))
        assert [type(m) for m in heard if isinstance(m, (protocol.StageDown, protocol.StageUp))] == \
            [protocol.StageDown, protocol.StageUp], heard
        assert not subs["intruder"].poll(500)
    finally:
        ctx.destroy(linger=0)
