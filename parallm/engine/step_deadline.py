"""How long an engine's step may run before the engine counts as hung (issue 38): a tensor-parallel
group's rank 0 (distributed.Leader) and a one-process engine stage (stages/engine.py) alike.

A rank that dies ends the group at once (its process exits, the others' collectives fail). A rank
that hangs alive (stopped, or stuck in a collective) ends nothing: every other rank waits for it
inside the step's all-sums, and rank 0's heartbeat thread still answers, which proves nothing about
progress. The proof of progress is the step counter: rank 0's steps cannot finish unless every rank
runs the same passes. So rank 0 gives every step a deadline when it starts it, and its heartbeat
carries how long the step in progress has run and that deadline; the supervisor restarts the group
when a step outlives its deadline (or rank 0, silent, was last heard inside a step whose deadline has
passed) exactly as when a rank dies: every request in flight ends with a retryable 503.

One engine process is the same with one rank: a device call that never returns, or a native call that
holds the loop, leaves the heartbeat thread answering while no step ends (before this, only
supervisor.stall_after_s, 300 s, caught it); a stopped process stops its heartbeats mid-step, and the
supervisor keeps the deadline of the step it last heard of (stopped between two steps while it holds
requests, it is held to that deadline from its last heartbeat: launch/process.py). Its step is the
engine's `step` (or the `flush` of a paused one): what happens between steps (adapter and weight loads,
grammars compiled on their own thread, the pooling pass, model start-up and warm-up) is not inside any, so
it has no deadline; a disk-tier block read inside a step runs `paused` (below).

The deadline is measured against the group's own recent steps, so that slow but alive is not hung:

    deadline = floor_s + factor x (expected + replay + first)

- expected: the longest of the last WINDOW steps, or the step's predicted work (the pacer's cost
  model, pacing.pass_work: its decode rows at their contexts and the prefill chunk it may take) at the
  highest seconds per unit of work those steps ran at, whichever is longer: a long prompt's first
  chunk after a run of short decode steps gets the time its work predicts;
- replay: the seconds rank 0 spent on the calls it recorded since the last step (an adapter loaded,
  a weight update): the other ranks replay them before this step's collectives, so rank 0 waits that
  long for them inside the step (a wait the recent steps do not count: the steps after it stay tight);
- first: for a step of a kind not seen yet (its decode rows and whether it may prefill), the longest
  step that was the first of its kind so far: the first pass of a shape builds what MLX builds on first
  use (compiled kernels, cuDNN graphs); before any step has run, the warm-up's whole time.

Work inside a step that is slow by nature and proves progress each time it returns (the prefix cache's
disk tier reading a block back) runs inside `paused()`: meanwhile the step reports no deadline, and after
it the deadline moves by its time, which the recent steps do not count.

`floor_s` 0 turns the deadline off (then only supervisor.stall_after_s catches a hang).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Hashable, Iterator

from .pacing import pass_work

WINDOW = 64  # recent steps the expected time is measured against


def step_kind_and_work(engine: Any) -> tuple[tuple[int, bool], float]:
    """What the engine's next step may do, before it is scheduled: its kind (decode rows, whether it may
    prefill) and its work by the pacer's cost model (pacing.pass_work: the running rows at their contexts
    and a chunk of up to max_prefill_tokens at the prefilling prompts' furthest position)."""
    s = engine.scheduler
    contexts = [q.num_computed for q in s.running]
    pending = sum(q.prefill_remaining for q in s.prefilling) + (s.max_prefill_tokens if len(s.waiting) else 0)
    tokens = min(s.max_prefill_tokens, pending)
    start = max((q.num_computed for q in s.prefilling), default=0)
    work = pass_work(engine.pacer.weight, [start] if tokens else [], [tokens] if tokens else [], contexts)
    return (len(contexts), tokens > 0), work


class WindowMax:
    """The largest of the values pushed at the last `size` step indices, in O(1) amortized a push: the
    deadline is computed every step of the served single stream, where a walk over the 64 recent steps
    (three of them, ~200 generator steps) was the engine stage's largest per-step cost beside the step
    (issue 37, item 3)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._q: deque[tuple[int, float]] = deque()  # (step index, value), values decreasing

    def push(self, index: int, value: float) -> None:
        q = self._q
        while q and q[-1][1] <= value:
            q.pop()
        q.append((index, value))

    def max(self, newest: int, default: float = 0.0) -> float:
        """The largest value pushed at indices (newest - size, newest], else `default`."""
        q = self._q
        while q and q[0][0] <= newest - self.size:
            q.popleft()
        return q[0][1] if q else default


class StepDeadline:
    """An engine's deadline for each of its steps (module docstring). `begin` a step with what it
    may do, `end` it; `progress()` is what the heartbeat reports."""

    def __init__(self, floor_s: float, factor: float, warm_up_s: float = 0.0,
                 clock=time.monotonic) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self.warm_up_s = warm_up_s
        self.clock = clock
        self.recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (seconds, predicted work)
        self._steps = 0  # steps ended: the index of the newest in `recent` is _steps - 1
        self._longest = WindowMax(WINDOW)  # the largest seconds in `recent`
        self._rate = WindowMax(WINDOW)  # the largest seconds / work in `recent` (steps with work only)
        self.kinds: set[Hashable] = set()
        self.first_s = 0.0  # the longest step that was the first of its kind
        self.replay_s = 0.0  # rank 0's time in recorded calls since the last step
        self.paused_s = 0.0  # the step in progress's time in `paused` work
        self._current: tuple[float, float] | None = None  # (started, deadline) of the step in progress
        self._pending: tuple[Hashable, float, bool, float] | None = None  # kind, work, first of its kind, replay

    @property
    def enabled(self) -> bool:
        return self.floor_s > 0

    def replayed(self, seconds: float) -> None:
        """Rank 0 ran a recorded call for `seconds` (the other ranks replay it before the next step)."""
        self.replay_s += seconds

    def expected_s(self, work: float) -> float:
        """What a step of `work` units should take, by the recent steps (0 without any)."""
        if not self.recent:
            return 0.0
        newest = self._steps - 1
        return max(self._longest.max(newest), self._rate.max(newest) * work)

    def deadline_s(self, kind: Hashable, work: float) -> float:
        """The deadline of a step of `kind` and `work` starting now."""
        first = 0.0
        if kind not in self.kinds:
            first = self.first_s if self.recent else max(self.first_s, self.warm_up_s)
        return self.floor_s + self.factor * (self.expected_s(work) + self.replay_s + first)

    def begin(self, kind: Hashable, work: float) -> float:
        """A step starts; returns its deadline in seconds (0 when off)."""
        deadline = self.deadline_s(kind, work) if self.enabled else 0.0
        self._pending = (kind, work, kind not in self.kinds, self.replay_s)
        self._current = (self.clock(), deadline) if self.enabled else None
        self.replay_s = self.paused_s = 0.0
        return deadline

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Slow work that proves progress as it returns (a disk-tier block read) runs inside: meanwhile the
        step in progress reports no deadline; after it, its deadline moves by the work's time."""
        current = self._current
        if current is None:  # between steps, off, or already paused
            yield
            return
        t0 = self.clock()
        self._current = None
        try:
            yield
        finally:
            spent = self.clock() - t0
            self.paused_s += spent
            self._current = (current[0], current[1] + spent)

    def end(self) -> float:
        """The step ended (returned or raised); returns how long it took."""
        current, pending = self._current, self._pending
        self._current = self._pending = None
        if pending is None:
            return 0.0
        seconds = self.clock() - current[0] if current is not None else 0.0
        kind, work, first, replay = pending
        own = max(0.0, seconds - self.paused_s)  # a disk read's time is not the step's (`paused`)
        seconds_own = max(0.0, own - replay)  # the step's own time: not the others' replay
        self.recent.append((seconds_own, work))
        self._longest.push(self._steps, seconds_own)
        if work > 0:
            self._rate.push(self._steps, seconds_own / work)
        self._steps += 1
        self.kinds.add(kind)
        if first:
            self.first_s = max(self.first_s, own)
        return seconds

    def progress(self) -> tuple[float, float]:
        """(seconds the step in progress has run, its deadline), (0, 0) between steps or when off.
        Read by the heartbeat thread: one attribute read, so never half of one step and half of another."""
        current = self._current
        if current is None:
            return 0.0, 0.0
        return round(self.clock() - current[0], 3), round(current[1], 3)


def one_engine_deadline(engine: Any, floor_s: float, factor: float, warm_up_s: float = 0.0) -> StepDeadline:
    """The deadline of a one-process engine's steps (the engine stage's): its disk tier's block reads run
    `paused`."""
    deadline = StepDeadline(floor_s, factor, warm_up_s)
    if engine.disk_tier is not None:
        engine.disk_tier.reading = deadline.paused
    return deadline
