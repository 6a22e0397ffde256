"""The engine stage's loop split (stats' `loop`): a poll's wait while idle is not counted as inbox work."""

from __future__ import annotations

import tempfile
import threading
import time

import zmq

from parallm import protocol, routing
from parallm.config import build_config
from parallm.engine.constraints import Constraints
from parallm.engine.request import SeqOutput
from parallm.protocol import EngineStats
from parallm.runtime import StageRuntime
from parallm.stages.engine import EngineStage
from parallm.transport import Sender, open_socket


class IdleThenOneStep:
    """No work until the stage has received a message; then one step, after which the stage stops."""

    constraints = Constraints(8, [0])  # the stage compiles requests' grammars through it (none here)

    def __init__(self, rt: StageRuntime) -> None:
        self.rt, self.stage, self.last_batch_size = rt, None, 1

    def has_work(self) -> bool:
        return self.stage is not None and self.stage.handled > 0

    def owes_outputs(self) -> bool:
        return False

    def step(self, emit: object = None) -> list[SeqOutput]:
        self.rt.shutting_down = True
        return [SeqOutput(rid="r", index=0, token_ids=[1], adapter="", version=0)]

    def request_ids(self) -> list[str]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats()


def test_an_idle_wait_before_a_message_is_not_inbox_time():
    config = build_config(environ={}, overrides={"transport": {"run_dir": tempfile.mkdtemp(prefix="loop-stats-")},
                                                 "supervisor": {"heartbeat_s": 2.0}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True)
    engine = IdleThenOneStep(rt)
    stage = EngineStage(config, rt, engine, {})
    engine.stage = stage
    to_engine = Sender(open_socket(ctx, zmq.PUSH, routing.engine_address(rt.addrs, 0, config.engine), bind=False))
    threading.Timer(0.4, lambda: to_engine.send(protocol.GetStats(qid="q", reply_to=b"c"))).start()
    t0 = time.perf_counter()
    assert stage.run() == 0
    assert time.perf_counter() - t0 >= 0.35  # the loop did wait for the message
    loop = stage.stats().loop
    assert loop.steps == 1 and loop.ms_mean["inbox"] < 100, loop
    assert detok.poll(2000)  # the stats reply and the step's outputs went out
    detok.close(0)
