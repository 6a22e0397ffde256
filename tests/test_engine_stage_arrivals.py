"""Issue 30: the engine stage hands the engine the Submits that arrived while a step's prefill pass ran
(EngineStage.take_arrivals, Engine.step's `arrivals`), and keeps every other message in order: the first
one of another kind stops the reading and is handled right after the step, before anything read after it."""

from __future__ import annotations

import time

import pytest
import zmq

from parallm import protocol, routing
from parallm.config import build_config
from parallm.runtime import StageRuntime
from parallm.stages.engine import EngineStage
from parallm.transport import Receiver, Sender, open_socket
from tests._engine_helpers import make_engine, tiny_model


def submit(rid: str, max_tokens: int = 4) -> protocol.Submit:
    params = protocol.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return protocol.Submit(rid=rid, reply_to=b"c", prompt_ids=protocol.pack_ids([5, 6, 7]),
                           spec=protocol.RequestSpec(params=params))


@pytest.fixture
def stage(tmp_path):
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    s = EngineStage(config, rt, make_engine(tiny_model("llama")), {})
    s.detok = detok
    s.client = Sender(open_socket(ctx, zmq.PUSH, routing.engine_address(rt.addrs, 0, config.engine), bind=False))
    yield s
    ctx.destroy(0)


def queued(stage: EngineStage, *messages: protocol.Message) -> None:
    """Send `messages` to the stage's inbox and wait until they are there (unread)."""
    for m in messages:
        stage.client.send(m)
    assert stage.inbox.sock.poll(2000, zmq.POLLIN)
    time.sleep(0.2)


def outputs_by_step(stage: EngineStage) -> dict[str, list[int]]:
    """rid -> the stage step numbers of the StepOutputs that carried its outputs."""
    got: dict[str, list[int]] = {}
    while (m := stage.detok.recv(timeout_ms=100)) is not None:
        for o in getattr(m, "outputs", []):
            got.setdefault(o.rid, []).append(m.step)
    return got


def test_a_submit_that_arrives_during_the_prefill_pass_rides_in_the_decode_pass(stage):
    stage.handle(submit("first"))
    # sent while nothing reads the inbox: as if they arrived while the step's prefill pass ran
    queued(stage, submit("joins"), protocol.Abort(rids=["first"]), submit("after"))
    assert stage.work()
    # "joins" went in between the passes and got its first token in this step; the Abort stopped the reading
    # and was handled right after the step; "after" is still in the inbox
    assert stage.engine.stats().mixed_passes == 1
    assert "first" not in stage.engine.request_ids() or stage.engine._requests["first"][0].is_finished
    assert "after" not in stage.engine.request_ids() and stage.deferred is None
    steps = outputs_by_step(stage)
    assert steps["joins"] == [1] and steps["first"][0] == 1
    for m in stage.inbox.drain():
        stage.handle(m)
    assert "after" in stage.engine.request_ids()
    while stage.work():
        pass
    assert not stage.engine.has_work()
