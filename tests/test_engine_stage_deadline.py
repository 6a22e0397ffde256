"""A one-process engine stage gives each engine step a deadline its heartbeat carries (issue 38, item 5;
parallm/engine/step_deadline.py): a step within it is never overdue (a long prompt after short decode
steps included), a step that hangs past it is overdue to the supervisor, nothing is due between steps, a
disk-tier read inside a step has no deadline, and engine.hang_floor_s 0 turns it off."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from parallm import protocol
from parallm.config import Config, EngineConfig, KVConfig, build_config
from parallm.engine import Engine, EngineModel
from parallm.launch.process import StageProcess, StageSpec
from parallm.launch.supervisor import Supervisor
from parallm.runtime import StageRuntime
from parallm.stages.engine import EngineStage
from parallm.transport import Receiver, open_socket
from tests._engine_helpers import make_engine, tiny_model


def submit(rid: str, prompt: list[int], max_tokens: int = 8) -> protocol.Submit:
    params = protocol.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return protocol.Submit(rid=rid, reply_to=b"c", prompt_ids=protocol.pack_ids(prompt),
                           spec=protocol.RequestSpec(params=params))


@pytest.fixture
def make_stage(tmp_path):
    """An engine stage over `engine` (a tiny llama's by default), with `settings` of the engine section;
    its runtime's heartbeats go to a socket the test reads (`stage.beats`)."""
    made = []

    def make(engine: Engine | None = None, **settings) -> EngineStage:
        run = tmp_path / f"run{len(made)}"
        run.mkdir()
        config = build_config(environ={}, overrides={"transport": {"run_dir": str(run)}, "engine": settings})
        ctx = zmq.Context()
        rt = StageRuntime(config, "engine", ctx=ctx)
        detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
        beats = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.supervisor, bind=True), protocol.SupervisorInbound)
        stage = EngineStage(config, rt, engine or make_engine(tiny_model("llama"), max_model_len=512), {})
        stage.beats = beats
        made.append((ctx, detok, beats))
        return stage

    yield make
    for ctx, detok, beats in made:
        detok.sock.close(0)
        beats.sock.close(0)
        ctx.destroy(0)


def watch_steps(stage: EngineStage, inside=lambda: None) -> list[tuple[float, float, float]]:
    """Each engine step's (age, deadline) as the heartbeat would read them at its start, and its seconds;
    `inside` runs within each step."""
    seen: list[tuple[float, float, float]] = []
    step = stage.engine.step

    def watched(*args, **kwargs):
        age, deadline = stage.rt.step_progress()
        t0 = time.monotonic()
        inside()
        try:
            return step(*args, **kwargs)
        finally:
            seen.append((age, deadline, time.monotonic() - t0))

    stage.engine.step = watched
    return seen


def run_to_end(stage: EngineStage) -> None:
    while stage.engine.has_work():
        stage.work()


def test_each_step_runs_under_a_deadline_it_never_outlives_and_none_is_due_between_steps(make_stage):
    stage = make_stage()
    seen = watch_steps(stage)
    for i in range(4):
        stage.handle(submit(f"d{i}", [5 + i, 6, 7], max_tokens=24))
    run_to_end(stage)
    stage.handle(submit("long", [(i * 7) % 97 + 1 for i in range(400)], max_tokens=2))  # after short steps
    run_to_end(stage)
    assert len(seen) > 24
    for age, deadline, seconds in seen:
        assert deadline >= stage.config.engine.hang_floor_s and age < 0.5
        assert seconds < deadline  # no step is ever overdue
    assert stage.rt.step_progress() == (0.0, 0.0)  # between steps nothing is due


def test_a_step_that_hangs_past_its_deadline_is_overdue_to_the_supervisor(make_stage):
    stage = make_stage(hang_floor_s=0.2, hang_factor=1.0)
    beats: list[protocol.Heartbeat] = []

    def hang() -> None:  # the engine loop stuck inside a step while the heartbeat thread still answers
        time.sleep(0.4)
        stage.rt._send_beat(stage.rt._to_supervisor)
        beats.append(stage.beats.recv(timeout_ms=5000))

    watch_steps(stage, hang)
    stage.handle(submit("a", [5, 6, 7], max_tokens=1))
    stage.work()
    beat = beats[0]
    assert isinstance(beat, protocol.Heartbeat) and beat.step_deadline_s > 0
    assert beat.step_age_s > beat.step_deadline_s
    supervisor = Supervisor(stage.config)
    engine = StageProcess(StageSpec("engine"), proc=object(), pid=os.getpid())
    supervisor.stages = [engine]
    supervisor._handle(beat)
    assert engine.overdue_s(time.monotonic()) > 0  # the supervisor restarts it


def test_hang_floor_0_turns_the_deadline_off(make_stage):
    stage = make_stage(hang_floor_s=0.0)
    seen = watch_steps(stage)
    stage.handle(submit("a", [5, 6, 7], max_tokens=4))
    run_to_end(stage)
    assert seen and all(deadline == 0.0 for _, deadline, _ in seen)


def test_a_disk_tier_read_inside_a_step_has_no_deadline(make_stage, tmp_path):
    engine = Engine(EngineModel(tiny_model("llama"), (), 512),
                    Config(engine=EngineConfig(kv_budget_mb=2.0, block_size=4),
                           kv=KVConfig(disk_dir=str(tmp_path / "kv"), disk_policy="write_through")))
    stage = make_stage(engine)
    assert engine.disk_tier.reading == stage.deadline.paused
    prompt = [(i * 7) % 97 + 1 for i in range(41)]
    stage.handle(submit("a", prompt, max_tokens=2))
    run_to_end(stage)
    engine.disk_tier.disk.flush()
    engine.drop_cached_blocks()
    during: list[tuple[float, float]] = []
    get = engine.disk_tier.disk.get

    def read(*args, **kwargs):
        during.append(stage.rt.step_progress())
        return get(*args, **kwargs)

    engine.disk_tier.disk.get = read
    stage.handle(submit("b", prompt, max_tokens=2))
    run_to_end(stage)
    assert engine.stats().kv_disk.hits == 10
    assert during and all(p == (0.0, 0.0) for p in during)  # nothing due while a block is read
    engine.close()
