import zmq

from parallm import protocol as p
from parallm.config import build_config
from parallm.transport import Receiver, Sender, addresses, open_socket


def test_addresses_derive_from_config(tmp_path):
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)},
                                                 "tokenizer": {"replicas": 2}})
    addrs = addresses(config)
    assert addrs.engine == f"ipc://{tmp_path}/engine.sock"
    assert len(addrs.tokenizers) == 2
    tcp = addresses(build_config(environ={}, overrides={"transport": {"kind": "tcp", "tcp_base_port": 7000}}))
    assert tcp.engine == "tcp://127.0.0.1:7000"
    assert len({tcp.engine, tcp.detok, tcp.router, tcp.supervisor, tcp.control, tcp.rollouts, tcp.adapters,
                tcp.training, *tcp.tokenizers}) == 9


def test_malformed_frames_are_dropped_not_raised(tmp_path):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/t.sock"
    receiver = Receiver(open_socket(ctx, zmq.PULL, address, bind=True), p.EngineInbound, name="t")
    raw = open_socket(ctx, zmq.PUSH, address, bind=False)
    sender = Sender(raw)
    raw.send(b"not msgpack at all")
    raw.send(p.encode(p.Track(rid="x", reply_to=b"", prompt_ids=b"", spec=p.RequestSpec())))  # valid message, wrong socket
    sender.send(p.Abort(rids=["a"]))  # same socket, so it arrives after the two bad frames
    got = receiver.recv(timeout_ms=2000)
    assert isinstance(got, p.Abort) and got.rids == ["a"]
    assert receiver.dropped == 2
    for s in (raw, receiver.sock):
        s.close(0)
    ctx.term()
