"""Issue 37 (single stream): the engine stage's integrity check, which walks every block of the prefix
pool, runs once the engine has been idle for IDLE_CHECK_AFTER_S, not the moment a request ends, so a
single stream's next request never waits behind it; it still runs once per idle spell."""

from __future__ import annotations

import time

import pytest
import zmq

from parallm import protocol
from parallm.config import build_config
from parallm.runtime import StageRuntime
from parallm.stages import engine as engine_stage
from parallm.stages.engine import EngineStage
from parallm.transport import Receiver, open_socket
from tests._engine_helpers import make_engine, tiny_model
from tests.test_engine_stage_compile import submit


@pytest.fixture
def stage(tmp_path):
    (tmp_path / "run").mkdir()
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path / "run")}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    s = EngineStage(config, rt, make_engine(tiny_model("llama")), {})
    yield s
    detok.sock.close(0)
    ctx.destroy(0)


def run_to_end(stage: EngineStage) -> None:
    while stage.engine.has_work():
        stage.work()


def test_the_idle_check_waits_for_an_idle_spell(stage):
    stage.handle(submit("a", max_tokens=4))
    run_to_end(stage)
    assert stage.work() is False  # idle at once: the check is owed, not run
    assert stage.integrity_checks == 0
    assert 1 <= stage.idle_wait_ms() <= 1000 * engine_stage.IDLE_CHECK_AFTER_S + 1  # the idle poll wakes for it
    stage.handle(submit("b", max_tokens=4))  # the next request is served first
    run_to_end(stage)
    stage.work()
    assert stage.integrity_checks == 0
    time.sleep(engine_stage.IDLE_CHECK_AFTER_S)
    stage.work()
    assert (stage.integrity_checks, stage.integrity_failures) == (1, 0)
    stage.work()
    assert stage.integrity_checks == 1  # once per idle spell
    assert stage.idle_wait_ms() == stage.beat_ms  # nothing owed: the idle poll waits a heartbeat


def test_no_check_is_owed_while_paused_with_work(stage):
    stage.handle(submit("a", max_tokens=64))
    stage.work()
    stage.handle(protocol.Pause(mode="keep"))
    time.sleep(engine_stage.IDLE_CHECK_AFTER_S)
    stage.work()
    assert stage.integrity_checks == 0
    assert stage.idle_wait_ms() == stage.beat_ms  # not a poll every millisecond while it waits
