"""What the engine counts per step since it started (or warmed up): steps, the decode batch sizes,
the packed (mixed) passes and the seconds each phase of a step took; EngineStats reports them."""

from __future__ import annotations

from collections import Counter
from typing import Any


class StepCounters:
    def __init__(self) -> None:
        self.steps = 0
        self.last_batch = 0  # rows of the last decode pass
        self.mixed_passes = 0  # steps whose prompt chunks rode in the decode pass
        self.decode_batches: Counter[int] = Counter()  # decode passes by their number of rows
        self.phase_s: Counter[str] = Counter()  # seconds by phase (schedule, mixed, prefill, launch, read)

    def begin(self) -> int:
        """A step starts; its number."""
        self.steps += 1
        return self.steps

    def decoded(self, rows: int) -> None:
        self.decode_batches[rows] += 1
        self.last_batch = rows

    def reset(self) -> None:
        self.__init__()

    def stats(self) -> dict[str, Any]:
        """EngineStats' fields these counters fill."""
        n = max(1, self.steps)
        return {"steps": self.steps, "mixed_passes": self.mixed_passes,
                "decode_batch_hist": dict(sorted(self.decode_batches.items())),
                "max_decode_batch": max(self.decode_batches, default=0),
                "step_ms_mean": {k: 1000 * v / n for k, v in self.phase_s.items()}}
