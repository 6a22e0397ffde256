"""Issue 33 item 5: the engine leaves `engine.training_share` of the device to a trainer's update while
one runs (engine/device_share.py; the trainer's TrainingPhase messages on the adapters socket)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from parallm import protocol
from parallm.config import ConfigError, build_config
from parallm.engine.device_share import MAX_REST_S, DeviceShare
from parallm.runtime import StageRuntime
from parallm.stages.engine import EngineStage
from parallm.transport import Receiver, open_socket
from tests._engine_helpers import make_engine, tiny_model
from tests.test_engine_stage_compile import submit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rests_in_proportion_only_while_an_update_runs():
    clock = Clock()
    share = DeviceShare(0.5, clock)
    share.after_step(0.2)
    assert share.resting_s() == 0 and share.rested_s == 0          # no trainer updating: never rests
    share.on_phase("t", True, 30.0)
    share.after_step(0.2)
    assert share.resting_s() == pytest.approx(0.2)                  # s / (1 - s) = 1: rests as long as it stepped
    clock.now += 0.05
    assert share.resting_s() == pytest.approx(0.15)
    clock.now += 0.2
    assert share.resting_s() == 0
    assert share.rested_s == pytest.approx(0.2) and share.phases == 1
    three_quarters = DeviceShare(0.75, clock)
    three_quarters.on_phase("t", True, 30.0)
    three_quarters.after_step(0.1)
    assert three_quarters.resting_s() == pytest.approx(0.3)
    three_quarters.after_step(10.0)                                 # a stalled step never stops it long
    assert three_quarters.resting_s() == pytest.approx(MAX_REST_S)


def test_a_phase_ends_with_its_message_or_its_lease_and_the_untaken_rest_is_not_counted():
    clock = Clock()
    share = DeviceShare(0.5, clock)
    share.on_phase("a", True, 5.0)
    share.on_phase("b", True, 5.0)
    share.after_step(0.4)
    share.on_phase("a", False, 5.0)
    assert share.resting_s() == pytest.approx(0.4)                  # b still updates
    clock.now += 0.1
    share.on_phase("b", False, 5.0)
    assert share.resting_s() == 0 and share.rested_s == pytest.approx(0.1)
    share.on_phase("a", True, 5.0)                                  # a trainer that died mid-update...
    clock.now += 5.0
    share.after_step(0.4)
    assert not share.training() and share.resting_s() == 0          # ...lapses with its lease
    assert share.phases == 3
    share.on_phase("a", True, 5.0)
    share.on_phase("a", True, 5.0)                                  # a renewal is not a new phase
    assert share.phases == 4
    assert DeviceShare(0.0, clock).resting_s() == 0


def test_the_share_and_the_lease_are_bounded_where_they_are_read():
    with pytest.raises(ConfigError, match="engine.training_share"):
        build_config(environ={}, overrides={"engine": {"training_share": 1.0}})
    with pytest.raises(ConfigError, match="engine.training_share"):
        build_config(environ={}, overrides={"engine": {"training_share": -0.1}})
    for lease in (0, -1, 1e9):
        frame = msgspec.msgpack.encode({"type": "training_phase", "trainer": "t", "updating": True, "lease_s": lease})
        with pytest.raises(msgspec.ValidationError, match="lease_s"):
            msgspec.msgpack.decode(frame, type=protocol.EngineInbound)


@pytest.fixture
def stage(tmp_path):
    (tmp_path / "run").mkdir()
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path / "run")},
                                                 "engine": {"training_share": 0.5}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    s = EngineStage(config, rt, make_engine(tiny_model("llama")), {})
    s.detok = detok
    yield s
    s.reads.close()
    ctx.destroy(0)


def test_the_engine_stage_rests_while_a_trainer_updates_and_steps_again_when_it_ends(stage):
    clock = Clock()  # stands still unless moved: the rest cannot run out while a loaded machine is slow
    stage.share = DeviceShare(0.5, clock)
    stage.handle(submit("r", max_tokens=200))
    assert stage.work() and stage.work()                            # no trainer: steps back to back
    assert stage.stats().training_rest_s == 0
    stage.handle(protocol.TrainingPhase(trainer="trainer", updating=True, lease_s=30.0))
    assert stage.work()                                             # a step, then a rest as long as it
    assert stage.share.resting_s() > 0
    assert not stage.work()                                         # resting: no step
    assert 1 <= stage.idle_wait_ms() <= 1000                        # the poll wakes when the rest ends
    clock.now += MAX_REST_S
    assert stage.work()                                             # rested: the next step, then a rest again
    assert not stage.work()
    stats = stage.stats()
    assert stats.training_updating and stats.training_phases == 1 and stats.training_rest_s > 0
    assert stats.training_share == 0.5
    stage.handle(protocol.TrainingPhase(trainer="trainer", updating=False))
    assert stage.work() and stage.work()                            # the update ended: back to back again
    assert not stage.stats().training_updating
