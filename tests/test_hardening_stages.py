"""Stage fault handling without a model: an engine step that raises, a message a handler cannot
process, a ZeroMQ client that disconnects, a stats query on the router, oversized frames."""

from __future__ import annotations

import time

import pytest
import zmq

from parallm import protocol
from parallm.config import build_config
from parallm.engine.constraints import Constraints
from parallm.runtime import StageRuntime
from parallm.transport import Receiver, open_socket, set_max_message_bytes


@pytest.fixture
def config(tmp_path):
    return build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)},
                                               "supervisor": {"heartbeat_s": 0.05}})


class FakeEngine:
    """What EngineStage drives; `step` raises like MLX out of memory."""

    last_batch_size = 0
    constraints = Constraints(8, [0])  # the stage compiles requests' grammars through it (none here)

    def __init__(self) -> None:
        self.rids = ["r1", "r2"]

    def has_work(self) -> bool:
        return True

    def step(self):
        raise RuntimeError("[metal::malloc] Attempting to allocate more memory than is available")

    def request_ids(self):
        return list(self.rids)

    def add_request(self, request) -> None:
        raise ValueError("a bug this request triggers")

    def stats(self) -> dict:
        return {}


def collect(receiver: Receiver, want: int, timeout: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        message = receiver.recv(timeout_ms=100)
        if message is not None:
            got.append(message)
    return got


def test_engine_step_error_fails_requests_retryably_and_exits_nonzero(config):
    from parallm.stages.engine import EngineStage

    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    stage = EngineStage(config, rt, FakeEngine(), {})
    assert stage.run() == 1
    errors = collect(detok, 2)
    assert [(e.rid, e.status, e.retryable, e.code) for e in errors] == \
        [("r1", 503, True, "engine_error"), ("r2", 503, True, "engine_error")]
    ctx.destroy(0)


def test_a_message_that_breaks_the_engine_is_answered_and_dropped(config, caplog):
    from parallm.stages.engine import EngineStage

    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    stage = EngineStage(config, rt, FakeEngine(), {})
    stage.safely(stage.handle, protocol.Submit(rid="bad", reply_to=b"c", prompt_ids=protocol.pack_ids([1, 2])))
    [error] = collect(detok, 1)
    assert (error.rid, error.status, error.reply_to) == ("bad", 400, b"c")
    # the exception's text (server paths, errno strings) stays in the log; the client learns its type
    assert "a bug this request triggers" not in error.message and "ValueError" in error.message
    # the engine's line about it carries the request id, as ingress', the tokenizer's and the detokenizer's do
    assert [r.request_id for r in caplog.records if r.name == "parallm.engine.stage"] == ["bad"]
    ctx.destroy(0)


class CountingEngine(FakeEngine):
    def stats(self) -> protocol.EngineStats:
        return protocol.EngineStats()


def test_malformed_frames_on_the_adapters_socket_are_counted_with_the_inbox(config):
    """Issue 22: every decode failure dropped and counted — the trainers' PUB socket (adapters) as
    well as the inbox add to EngineStats.dropped_frames (/metrics parallm_dropped_frames)."""
    from parallm import routing
    from parallm.stages.engine import EngineStage

    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    stage = EngineStage(config, rt, CountingEngine(), {})
    pub = ctx.socket(zmq.PUB)
    pub.connect(routing.adapters_address(rt.addrs, 0))
    deadline = time.monotonic() + 5
    while stage.adapter_sub.dropped == 0 and time.monotonic() < deadline:
        pub.send(b"\xc1 not msgpack")  # PUB drops what it sends before the subscription arrives
        list(stage.adapter_sub.drain())
        time.sleep(0.02)
    assert stage.adapter_sub.dropped >= 1
    assert stage.stats().dropped_frames == stage.inbox.dropped + stage.adapter_sub.dropped
    ctx.destroy(0)


def _detok_stage(config, ctx):
    from parallm.stages.detokenizer import DetokenizerStage, _Request

    rt = StageRuntime(config, "detokenizer", ctx=ctx)
    engine = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.engine, bind=True), protocol.EngineInbound)
    stage = DetokenizerStage(config, rt, tokenizer=None, model_name="m")
    return stage, engine, _Request


def test_detokenizer_aborts_requests_of_a_client_that_went_away(config):
    ctx = zmq.Context()
    stage, engine, _Request = _detok_stage(config, ctx)
    client = open_socket(ctx, zmq.DEALER, stage.rt.addrs.router, bind=False, identity=b"alive")
    client.send(protocol.encode(protocol.Hello()))
    deadline = time.monotonic() + 5
    while not list(stage.router.drain()) and time.monotonic() < deadline:
        time.sleep(0.02)
    stage.requests["a"] = _Request(b"gone", [], 1)
    stage.requests["b"] = _Request(b"gone", [], 1)
    stage.requests["c"] = _Request(b"alive", [], 1)
    assert not stage.router.send(b"gone", protocol.Outputs(items=[]))
    assert stage.router.send(b"alive", protocol.Outputs(items=[]))
    [abort] = collect(engine, 1)
    assert sorted(abort.rids) == ["a", "b"]
    assert list(stage.requests) == ["c"] and stage.stats().client_gone_aborts == 2
    ctx.destroy(0)


def test_detokenizer_answers_a_stats_query_on_its_router(config):
    ctx = zmq.Context()
    stage, _, _ = _detok_stage(config, ctx)
    client = open_socket(ctx, zmq.DEALER, stage.rt.addrs.router, bind=False, identity=b"me")
    client.send(protocol.encode(protocol.GetStats(qid="q1", reply_to=b"me")))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for identity, message in stage.router.drain():
            stage.safely(stage.clients[type(message)], identity, message)
        if client.poll(50):
            break
    reply = protocol.decode(client.recv())
    assert isinstance(reply, protocol.StatsReply) and reply.qid == "q1"
    assert isinstance(reply.stats, protocol.DetokenizerStats) and reply.stats.in_flight == 0
    ctx.destroy(0)


def test_oversized_and_malformed_frames_are_dropped_and_the_socket_keeps_serving(tmp_path):
    set_max_message_bytes(1 << 16)
    try:
        ctx = zmq.Context()
        address = f"ipc://{tmp_path}/s.sock"
        pull = Receiver(open_socket(ctx, zmq.PULL, address, bind=True), protocol.EngineInbound, name="t")
        big = ctx.socket(zmq.PUSH)
        big.connect(address)
        big.send(b"x" * (1 << 17))
        small = ctx.socket(zmq.PUSH)
        small.connect(address)
        small.send(b"\xc1 not msgpack")
        small.send(protocol.encode(protocol.Abort(rids=["ok"])))
        [message] = collect(pull, 1)
        assert message.rids == ["ok"] and pull.dropped == 1
        assert pull.recv(timeout_ms=200) is None  # the oversized one never arrived
        ctx.destroy(0)
    finally:
        set_max_message_bytes(512 << 20)
