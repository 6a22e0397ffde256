"""The device's share left to training (issue 33 item 5): while a trainer's update runs on the same
device as the engine, the engine rests after each step so that the trainer gets about
`engine.training_share` of the device's time.

A GPU time-slices between processes (and two processes on one CPU split its cores), so an engine
that steps back to back takes most of the device while a trainer's GRPO update runs beside it: the
update is slow, the next version late, rollouts stale. The seed design asks for a configurable split.
After a step of `t` seconds the engine rests `t x s / (1 - s)` (s the share): over a run of steps
the engine computes `1 - s` of the wall time. It rests only while a trainer says its update runs
(protocol.TrainingPhase on the adapters socket, renewed after every micro-batch); a phase lapses after
its lease, so a trainer that died mid-update cannot leave the engine resting.
"""

from __future__ import annotations

import time
from typing import Callable

MAX_REST_S = 1.0  # one rest never longer than this, so a step that stalled cannot stop the engine long


class DeviceShare:
    """Whether the engine rests now, and the seconds it rested while trainers updated."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= share < 1:
            raise ValueError(f"training share must be in [0, 1), not {share}")
        self.share = share
        self.clock = clock
        self.updating: dict[str, float] = {}  # trainer -> when its update phase lapses
        self.rest_until = 0.0
        self.rested_s = 0.0      # total rest taken
        self.phases = 0          # update phases begun (TrainingPhase updating=True after a quiet one)

    def on_phase(self, trainer: str, updating: bool, lease_s: float) -> None:
        """A trainer's update began (or is still running: the lease renews) or ended."""
        now = self.clock()
        if updating:
            if self.updating.get(trainer, 0.0) <= now:
                self.phases += 1
            self.updating[trainer] = now + lease_s
        else:
            self.updating.pop(trainer, None)
            if not self.training(now):
                self._cut(now)

    def training(self, now: float | None = None) -> bool:
        """Whether some trainer's update phase is running (lapsed leases are dropped)."""
        now = self.clock() if now is None else now
        for name in [n for n, until in self.updating.items() if until <= now]:
            del self.updating[name]
        return bool(self.updating)

    def after_step(self, step_s: float) -> None:
        """The engine just stepped for `step_s` seconds: rest in proportion while a trainer updates."""
        if not self.share or step_s <= 0:
            return
        now = self.clock()
        if not self.training(now):
            return
        rest = min(MAX_REST_S, step_s * self.share / (1 - self.share))
        self.rest_until = now + rest
        self.rested_s += rest

    def resting_s(self) -> float:
        """Seconds of rest left now (0: the engine may step)."""
        if not self.rest_until:
            return 0.0
        now = self.clock()
        left = self.rest_until - now
        if left <= 0 or not self.training(now):
            self._cut(now)
            return 0.0
        return left

    def _cut(self, now: float) -> None:
        """End the rest now; what was not taken of it is not counted."""
        if self.rest_until > now:
            self.rested_s -= self.rest_until - now
        self.rest_until = 0.0
