"""An engine's step deadline (parallm/engine/step_deadline.py: a tensor-parallel group's, one engine's) and how the supervisor judges
it (launch/process.py): a slow step within its bound is never called hung, a step past it is, and the
bound follows the group's own steps (a long prefill's predicted work, a new kind of step's first-use
builds, the calls the other ranks replay first)."""

from __future__ import annotations

import tempfile
import time

import pytest
import zmq

from parallm import protocol
from parallm.config import build_config
from parallm.engine.step_deadline import WINDOW, StepDeadline
from parallm.launch.process import StageProcess, StageSpec
from parallm.runtime import StageRuntime
from parallm.transport import Receiver, open_socket

DECODE = (8, False)  # a step's kind: 8 decode rows, no prefill


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def steady(floor_s: float = 5.0, factor: float = 10.0, step_s: float = 0.1, steps: int = 20,
           work: float = 100.0) -> tuple[StepDeadline, Clock]:
    """A deadline that has seen `steps` decode steps of `step_s` seconds and `work` units each."""
    clock = Clock()
    d = StepDeadline(floor_s, factor, warm_up_s=3.0, clock=clock)
    for _ in range(steps):
        d.begin(DECODE, work)
        clock.t += step_s
        d.end()
    return d, clock


def supervisor_view(d: StepDeadline, heard_at: float) -> StageProcess:
    """The supervisor's record of rank 0 after a heartbeat at `heard_at` carrying d.progress()."""
    stage = StageProcess(StageSpec("engine"))
    stage.heard_step(*d.progress(), now=heard_at)
    return stage


def test_a_slow_step_within_its_bound_is_not_hung_and_one_past_it_is():
    d, clock = steady()
    deadline = d.begin(DECODE, 100.0)
    assert deadline == pytest.approx(5.0 + 10 * 0.1)  # the floor and ten times the longest recent step
    clock.t += deadline - 0.2  # 59x a usual step, still inside
    stage = supervisor_view(d, clock.t)
    assert stage.overdue_s(clock.t) == 0
    assert stage.overdue_s(clock.t + 0.1) == 0
    assert stage.overdue_s(clock.t + 0.3) > 0  # past it, with no newer heartbeat: hung
    clock.t += 0.1
    assert d.end() == pytest.approx(deadline - 0.1)  # it did end in time: the next step's bound grows with it
    assert d.begin(DECODE, 100.0) == pytest.approx(5.0 + 10 * (deadline - 0.1))


def test_a_rank_0_that_falls_silent_inside_a_step_is_caught_by_the_same_deadline():
    d, clock = steady()
    deadline = d.begin(DECODE, 100.0)
    clock.t += 1.0
    stage = supervisor_view(d, clock.t)  # the last heartbeat before rank 0 stopped
    assert stage.overdue_s(clock.t + deadline - 1.0 - 0.01) == 0
    assert stage.overdue_s(clock.t + deadline - 1.0 + 0.01) > 0


def test_between_steps_nothing_is_due():
    d, clock = steady()
    assert d.progress() == (0.0, 0.0)
    stage = supervisor_view(d, clock.t)
    assert stage.step_due == 0 and stage.overdue_s(clock.t + 1e6) == 0


def test_an_engine_stopped_between_steps_with_requests_in_flight_is_held_to_its_last_steps_deadline():
    """The CI failure of test_engine_hang.py: the last heartbeat before SIGSTOP came between two steps, which
    set no due time, and only dead_after_s's 10 s of silence caught the stopped engine."""
    d, clock = steady()
    stage = StageProcess(StageSpec("engine"))
    stage.in_flight = 8
    deadline = d.begin(DECODE, 100.0)
    stage.heard_step(*d.progress(), now=clock.t)  # a beat inside a step
    clock.t += 0.1
    d.end()
    stage.heard_step(*d.progress(), now=clock.t)  # the last beat: between steps, eight requests held
    assert stage.step_deadline_s == pytest.approx(deadline)
    assert stage.overdue_s(clock.t + deadline - 0.01) == 0
    assert stage.overdue_s(clock.t + deadline + 0.01) > 0  # silent since: hung
    clock.t += 3.0  # alive but busy between steps (an adapter load): its beats keep moving the due time
    stage.heard_step(*d.progress(), now=clock.t)
    assert stage.overdue_s(clock.t + deadline - 0.01) == 0
    stage.in_flight = 0  # nothing held: a silent idle engine is dead_after_s's to judge
    stage.heard_step(*d.progress(), now=clock.t)
    assert stage.step_due == 0 and stage.overdue_s(clock.t + 1e6) == 0


def test_before_any_step_was_heard_of_a_silent_engine_with_requests_has_no_due_time():
    stage = StageProcess(StageSpec("engine"))
    stage.in_flight = 3
    stage.heard_step(0.0, 0.0, now=1000.0)
    assert stage.step_due == 0 and stage.overdue_s(1e6) == 0


def test_a_long_prefill_gets_the_time_its_predicted_work_says():
    d, clock = steady(step_s=0.1, work=100.0)  # 0.001 s per unit of work
    prefill = (8, True)
    d.kinds.add(prefill)  # a kind seen before: no first-use allowance
    deadline = d.begin(prefill, 100_000.0)  # a chunk of 1,000x the work of a decode step
    assert deadline >= 5.0 + 10 * 100.0
    clock.t += 60.0  # 600x the recent steps, but what its work predicts
    assert supervisor_view(d, clock.t).overdue_s(clock.t) == 0


def test_a_new_kind_of_step_gets_the_slowest_first_use_so_far():
    clock = Clock()
    d = StepDeadline(5.0, 10.0, warm_up_s=3.0, clock=clock)
    assert d.begin(DECODE, 100.0) == pytest.approx(5.0 + 10 * 3.0)  # the first step: the warm-up's time for what MLX builds
    clock.t += 2.0  # its first use of this shape
    d.end()
    for _ in range(WINDOW):  # the first step leaves the window
        d.begin(DECODE, 100.0)
        clock.t += 0.1
        d.end()
    assert d.begin(DECODE, 100.0) == pytest.approx(5.0 + 10 * 0.1)  # a kind seen before
    d.end()
    assert d.begin((9, False), 100.0) == pytest.approx(5.0 + 10 * (0.1 + 2.0))  # a new one: the slowest first step so far


def test_calls_the_other_ranks_replay_first_extend_the_next_step():
    d, clock = steady()
    d.replayed(4.0)  # e.g. rank 0 loaded new weights for 4 s; the others load them before this step's all-sums
    assert d.begin(DECODE, 100.0) == pytest.approx(5.0 + 10 * (0.1 + 4.0))
    clock.t += 4.1  # rank 0 waited for them inside the step
    d.end()
    assert d.begin(DECODE, 100.0) == pytest.approx(5.0 + 10 * 0.1)  # only the step after them: the next ones are tight


def test_paused_work_inside_a_step_has_no_deadline_and_moves_it_by_its_time():
    d, clock = steady()
    deadline = d.begin(DECODE, 100.0)
    clock.t += 0.05
    with d.paused():  # a disk-tier block read: slow, and progress once it returns
        clock.t += 100.0
        assert d.progress() == (0.0, 0.0)  # nothing is due meanwhile
        with d.paused():  # nested: the outer one already paused the step
            clock.t += 1.0
    assert d.progress() == (pytest.approx(101.05), pytest.approx(deadline + 101.0))
    assert supervisor_view(d, clock.t).overdue_s(clock.t + deadline - 0.1) == 0
    d.end()
    assert d.recent[-1][0] == pytest.approx(0.05)  # the read's time is not the step's own: the next stays tight
    assert d.begin(DECODE, 100.0) == pytest.approx(deadline)
    d.end()
    with d.paused():  # between steps: nothing to move
        clock.t += 1.0
    assert d.progress() == (0.0, 0.0)


def test_floor_0_turns_it_off():
    clock = Clock()
    d = StepDeadline(0.0, 10.0, clock=clock)
    assert d.begin(DECODE, 100.0) == pytest.approx(0.0)
    clock.t += 1e6
    assert d.progress() == (0.0, 0.0)
    assert supervisor_view(d, clock.t).overdue_s(clock.t + 1e6) == 0


def test_the_heartbeat_thread_carries_the_step_in_progress():
    """The beat is sent by a thread while the stage's loop is inside a step: it reports the step's age
    and deadline, which the supervisor judges (the beat itself proves nothing about progress)."""
    ctx = zmq.Context()
    config = build_config(environ={}, overrides={"transport": {"run_dir": tempfile.mkdtemp(prefix="beat-")},
                                                 "supervisor": {"heartbeat_s": 0.05}})
    rt = StageRuntime(config, "engine", ctx=ctx)
    supervisor = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.supervisor, bind=True), protocol.SupervisorInbound)
    d = StepDeadline(0.3, 10.0)
    rt.step_progress = d.progress
    try:
        rt.heartbeat()
        d.begin(DECODE, 1.0)  # the step never ends: a rank hangs
        stage = StageProcess(StageSpec("engine"))
        end = time.monotonic() + 5
        while time.monotonic() < end and not stage.overdue_s(time.monotonic()):
            for m in supervisor.drain():
                if isinstance(m, protocol.Heartbeat):
                    stage.heard_step(m.step_age_s, m.step_deadline_s, time.monotonic())
            time.sleep(0.02)
        assert stage.step_deadline_s == pytest.approx(0.3)
        assert 0.3 <= d.progress()[0] < 2.0  # caught soon after its deadline
    finally:
        rt.close()
        supervisor.close()
        ctx.destroy(0)


class TwoRanks:
    """A group of two as rank 0 sees it (no collective runs: the model is not sharded)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def test_the_leader_gives_each_step_a_deadline_while_it_runs(tmp_path, monkeypatch):
    """Rank 0's steps, read from another thread (as the heartbeat thread does) while one runs: its age and its
    deadline (the configured floor, then the recent steps'), and nothing between steps."""
    from parallm.engine.distributed import Leader, control_addresses
    from tests._engine_helpers import greedy, make_engine, req, tiny_model

    calls_at, acks_at = control_addresses(str(tmp_path))
    follower = zmq.Context.instance().socket(zmq.SUB)  # rank 1 as the Leader sees it: subscribed, never acking
    follower.setsockopt(zmq.SUBSCRIBE, b"")
    follower.connect(calls_at)
    engine = make_engine(tiny_model("llama"))
    leader = Leader(engine, TwoRanks(), (calls_at, acks_at), warm_up_s=0.5)
    step, seen = engine.step, []

    def slow_step(*args, **kwargs):
        time.sleep(0.2)
        seen.append(leader.step_progress())
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", slow_step)
    try:
        leader.add_request(req("r", [1, 2, 3], greedy(4)))
        while leader.has_work():
            leader.step()
        assert leader.step_progress() == (0.0, 0.0)
    finally:
        leader.close()
        follower.close()
    floor, factor = engine.config.hang_floor_s, engine.config.hang_factor
    assert (floor, factor) == (5.0, 10.0)  # the defaults
    assert len(seen) >= 3 and all(age >= 0.2 for age, _ in seen)
    assert seen[0][1] >= floor + factor * 0.5  # the first step: the warm-up's time for what MLX builds
    assert all(floor + factor * 0.2 <= deadline < floor + factor * 2.0 for _, deadline in seen[2:])


def test_expected_time_is_the_window_maxima_of_the_recent_steps() -> None:
    """expected_s keeps its definition (the longest of the last WINDOW steps, or their highest seconds per
    unit of work times the step's work) while it no longer walks the window every step: random step times
    and works, zero works among them, checked against the definition after every step past the window."""
    import random

    rng = random.Random(7)
    clock = Clock()
    d = StepDeadline(5.0, 10.0, clock=clock)
    assert d.expected_s(10.0) == 0.0
    for i in range(3 * WINDOW):
        work = 0.0 if rng.random() < 0.2 else rng.uniform(1.0, 500.0)
        d.begin(DECODE, work)
        clock.t += rng.uniform(0.001, 0.2) * (20.0 if i == WINDOW // 2 else 1.0)  # one outlier that must expire
        d.end()
        for asked in (0.0, 1.0, 250.0):
            window = list(d.recent)
            longest = max(s for s, _ in window)
            rates = [s / w for s, w in window if w > 0]
            assert d.expected_s(asked) == max(longest, (max(rates) if rates else 0.0) * asked)
