"""Where the engine's steps go, a burst at a time: what each step ran (its passes, rows, prompt
tokens, row operations), how long each part took, and the slowest steps of the burst.

A burst is the steps from the first one after the engine had nothing to do for BURST_GAP_S to
the last one before such a pause: a benchmark's run (its closed loop leaves the engine idle only
for a client's round trip between requests), once its requests are done and the gap has passed,
is the last burst, so its figures can be read from stats() after the run without resetting
anything (ingress polls stats too).
Cheap: a few perf_counter reads and a small record per step; step times go into a histogram of
10%-wide buckets for the percentiles, so a burst that never ends (a server never idle) keeps a
bounded record.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter

from parallm.protocol import BurstStats, StepRecord

from .plan import RowOp

SLOWEST_KEPT = 8
BURST_GAP_S = 1.0
SHAPES_KEPT = 100_000  # distinct pass shapes remembered (past it, no shape is called new)
_BUCKET = math.log(1.1)  # step-time histogram: buckets 10% wide from 0.01 ms


def _bucket(ms: float) -> int:
    return max(0, int(math.log(max(ms, 0.01) / 0.01) / _BUCKET))


def _percentile(hist: Counter[int], n: int, q: float) -> float:
    """The upper edge of the bucket holding the q-quantile (within 10% of it)."""
    seen, want = 0, q * n
    for b in sorted(hist):
        seen += hist[b]
        if seen > want:
            return round(0.01 * math.exp(_BUCKET * (b + 1)), 3)
    return 0.0


class Burst:
    """The figures of one burst of steps (BurstStats once reported)."""

    def __init__(self, first_step: int) -> None:
        self.first_step = first_step
        self.started = time.perf_counter()
        self.ended = self.started
        self.steps = 0
        self.step_hist: Counter[int] = Counter()
        self.step_ms_max = 0.0
        self.passes: Counter[str] = Counter()
        self.phase_ms: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.prefill_tokens = 0
        self.prefill_padded = 0
        self.prefill_passes = 0
        self.new_shapes = 0
        self.new_shape_ms = 0.0
        self.prefill_ms = {True: [0, 0.0], False: [0, 0.0]}  # new prefill shape -> [passes, phase ms]
        self.admitted = 0
        self.preempted = 0
        self.max_decode_rows = 0
        self.slowest: list[tuple[float, int, StepRecord]] = []  # a min-heap of the SLOWEST_KEPT slowest

    def add(self, record: StepRecord) -> None:
        self.ended = time.perf_counter()
        self.steps += 1
        self.step_hist[_bucket(record.ms)] += 1
        self.step_ms_max = max(self.step_ms_max, record.ms)
        self.passes[record.kind] += 1
        for k, v in record.phase_ms.items():
            self.phase_ms[k] += v
        self.ops.update(record.ops)
        if record.prefill_rows:
            tally = self.prefill_ms[record.new_prefill_shape]
            tally[0] += 1
            tally[1] += record.phase_ms.get("prefill", 0.0) + record.phase_ms.get("mixed", 0.0)
            self.prefill_passes += 1
            self.prefill_tokens += record.prefill_tokens
            self.prefill_padded += record.prefill_padded
        if record.new_shape:
            self.new_shapes += 1
            self.new_shape_ms += record.ms
        self.admitted += record.admitted
        self.preempted += record.preempted
        self.max_decode_rows = max(self.max_decode_rows, record.decode_rows)
        item = (record.ms, record.step, record)
        if len(self.slowest) < SLOWEST_KEPT:
            heapq.heappush(self.slowest, item)
        elif item[:2] > self.slowest[0][:2]:
            heapq.heapreplace(self.slowest, item)

    def report(self, done: bool) -> BurstStats:
        n = max(1, self.prefill_passes)
        p50, p99 = (min(_percentile(self.step_hist, self.steps, q), self.step_ms_max) for q in (0.5, 0.99))
        return BurstStats(
            done=done, first_step=self.first_step, steps=self.steps, wall_s=round(self.ended - self.started, 3),
            step_ms_p50=p50, step_ms_p99=p99, step_ms_max=self.step_ms_max,
            passes=dict(self.passes), phase_ms={k: round(v, 3) for k, v in self.phase_ms.items()},
            ops=dict(self.ops), prefill_passes=self.prefill_passes, prefill_tokens_per_pass=self.prefill_tokens / n,
            prefill_padded_per_pass=self.prefill_padded / n, new_shapes=self.new_shapes,
            new_shape_ms=round(self.new_shape_ms, 3), new_prefill_shapes=self.prefill_ms[True][0],
            new_prefill_ms=round(self.prefill_ms[True][1], 3), known_prefill_passes=self.prefill_ms[False][0],
            known_prefill_ms=round(self.prefill_ms[False][1], 3), admitted=self.admitted, preempted=self.preempted,
            max_decode_rows=self.max_decode_rows,
            slowest=[r for _, _, r in sorted(self.slowest, key=lambda x: (-x[0], x[1]))])


class StepTracer:
    """The engine's step records: `begin` a step, note what it ran, `end` it."""

    def __init__(self) -> None:
        self.current: Burst | None = None
        self.last: Burst | None = None
        self._shapes: set[tuple] = set()
        self._prefill_shapes: set[tuple[int, int, int, int]] = set()
        self._record: StepRecord | None = None
        self._t0 = 0.0
        self._idle = False  # the last step left the engine with nothing to do

    def _close_if_idle(self, now: float) -> None:
        if self._idle and self.current is not None and now - self.current.ended >= BURST_GAP_S:
            self.last, self.current = self.current, None

    def reset(self) -> None:
        self.current = self.last = None
        self._shapes.clear()
        self._prefill_shapes.clear()
        self._idle = False

    def begin(self, step: int) -> None:
        self._t0 = time.perf_counter()
        self._close_if_idle(self._t0)
        self._record = StepRecord(step=step)
        if self.current is None:
            self.current = Burst(step)

    def phase(self, name: str, seconds: float) -> None:
        if self._record is not None:
            self._record.phase_ms[name] = self._record.phase_ms.get(name, 0.0) + 1000 * seconds

    def ops(self, ops: list[RowOp]) -> None:
        if self._record is not None:
            for op in ops:
                name = type(op).__name__
                self._record.ops[name] = self._record.ops.get(name, 0) + 1

    def plan(self, admitted: int, preempted: int) -> None:
        if self._record is not None:
            self._record.admitted += admitted
            self._record.preempted += preempted

    def prefill(self, rows: int, tokens: int, length: int, span: int, capacity: int) -> None:
        """A prefill pass (or the prompt chunks of a mixed one): rows, real tokens, padded length L,
        key positions attended, and the live buffer's capacity (its K/V slices' strides: MLX's cuDNN
        attention builds a graph per shape and stride)."""
        if self._record is not None:
            self._record.prefill_rows, self._record.prefill_tokens = rows, tokens
            self._record.prefill_padded, self._record.prefill_length = rows * length, length
            self._record.prefill_span = span
            shape = (rows, length, span, capacity)
            if shape not in self._prefill_shapes and len(self._prefill_shapes) < SHAPES_KEPT:
                self._prefill_shapes.add(shape)
                self._record.new_prefill_shape = True

    def decode(self, rows: int) -> None:
        if self._record is not None:
            self._record.decode_rows = rows

    def end(self, kind: str, has_work: bool) -> None:
        """Close the step: `kind` is what it ran ("decode", "prefill", "prefill+decode", "mixed",
        "prefill+mixed", "read": only tokens of an earlier pass read); without `has_work` the burst ends with it
        unless another step comes within BURST_GAP_S."""
        r, burst = self._record, self.current
        if r is None or burst is None:
            return
        r.kind = kind
        r.ms = round(1000 * (time.perf_counter() - self._t0), 3)
        r.phase_ms = {k: round(v, 3) for k, v in r.phase_ms.items()}
        shape = (kind, r.decode_rows, r.prefill_rows, r.prefill_length)
        if kind != "read" and shape not in self._shapes and len(self._shapes) < SHAPES_KEPT:
            self._shapes.add(shape)
            r.new_shape = True
        burst.add(r)
        self._record = None
        self._idle = not has_work

    def stats(self) -> tuple[BurstStats | None, BurstStats | None]:
        """(the burst in progress, the last finished one), either None if there is none."""
        self._close_if_idle(time.perf_counter())
        return (self.current.report(False) if self.current else None,
                self.last.report(True) if self.last else None)
