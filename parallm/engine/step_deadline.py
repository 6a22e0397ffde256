"""How long a tensor-parallel group's step may run before the group counts as hung (issue 38).

A rank that dies ends the group at once (its process exits, the others' collectives fail). A rank
that hangs alive (stopped, or stuck in a collective) ends nothing: every other rank waits for it
inside the step's all-sums, and rank 0's heartbeat thread still answers, which proves nothing about
progress. The proof of progress is the step counter: rank 0's steps cannot finish unless every rank
runs the same passes. So rank 0 gives every step a deadline when it starts it, and its heartbeat
carries how long the step in progress has run and that deadline; the supervisor restarts the group
when a step outlives its deadline (or rank 0, silent, was last heard inside a step whose deadline has
passed) exactly as when a rank dies: every request in flight ends with a retryable 503.

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

`floor_s` 0 turns the deadline off (then only supervisor.stall_after_s catches a hang).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Hashable

WINDOW = 64  # recent steps the expected time is measured against


class StepDeadline:
    """Rank 0's deadline for each step of its group (module docstring). `begin` a step with what it
    may do, `end` it; `progress()` is what the heartbeat reports."""

    def __init__(self, floor_s: float, factor: float, warm_up_s: float = 0.0,
                 clock=time.monotonic) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self.warm_up_s = warm_up_s
        self.clock = clock
        self.recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (seconds, predicted work)
        self.kinds: set[Hashable] = set()
        self.first_s = 0.0  # the longest step that was the first of its kind
        self.replay_s = 0.0  # rank 0's time in recorded calls since the last step
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
        longest = max(s for s, _ in self.recent)
        rate = max(s / w for s, w in self.recent if w > 0) if any(w > 0 for _, w in self.recent) else 0.0
        return max(longest, rate * work)

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
        self.replay_s = 0.0
        return deadline

    def end(self) -> float:
        """The step ended (returned or raised); returns how long it took."""
        current, pending = self._current, self._pending
        self._current = self._pending = None
        if pending is None:
            return 0.0
        seconds = self.clock() - current[0] if current is not None else 0.0
        kind, work, first, replay = pending
        self.recent.append((max(0.0, seconds - replay), work))  # the step's own time: not the others' replay
        self.kinds.add(kind)
        if first:
            self.first_s = max(self.first_s, seconds)
        return seconds

    def progress(self) -> tuple[float, float]:
        """(seconds the step in progress has run, its deadline), (0, 0) between steps or when off.
        Read by the heartbeat thread: one attribute read, so never half of one step and half of another."""
        current = self._current
        if current is None:
            return 0.0, 0.0
        return round(self.clock() - current[0], 3), round(current[1], 3)
