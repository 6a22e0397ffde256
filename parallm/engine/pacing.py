"""Prefill pacing: how many prompt tokens the next prefill pass may take so that its prompt chunks
cost about `engine.prefill_pass_s` of the pass's time, measured on this machine, this model.

A fixed token budget bounds a pass's tokens, not its time: on the 2-core CPU one 128-token chunk of
a 6k-token prompt took seconds near its end (attention over the whole context), and a short prompt
that arrived meanwhile waited for that pass, then shared the next one with the next chunk, then decoded
beside the one after (issue 30: a 2-token completion took 14.4 s while a 6k prompt prefilled).
vLLM bounds this with `long_prefill_token_threshold` (a long prompt's chunk is at most that many tokens
while others wait); tokens are a poor proxy when a chunk's cost grows with its position, so here the
budget follows a time target instead.

Cost model: a pass's seconds ~ f + a x W. W sums over its rows, a chunk of `n` tokens at positions
s .. s+n counting n x (C + s + n/2) (per-token matmul work C, in units of one position of attention
context) and a decode row at context c counting C + c; C comes from the model's shape
(`context_weight`). f is what a pass costs whatever its tokens (reading the weights, launching,
sampling). The engine reports a padded prefill pass's rows each as a chunk from the furthest start:
every row attends over the pass's whole span. Both are learned from the last WINDOW passes: `a` is the
median of the slopes between pairs of passes whose work differs by a quarter or more (Theil-Sen: a
stalled pass or two in the window move neither median; `a` is kept as it was while the window has no
such pair, and is seconds / W, f = 0, until it first has one), f the median of seconds - a x W. A
window of medians follows a real change of cost within about WINDOW / 2 passes; clamping each
observation to twice the prediction (the model before) would need several such half-windows to follow
a cost 8x the prediction.

Two bounds, the smaller wins: the chunk's own time, a x W of the chunk, at most the target (neither f
nor the decode rows of a mixed pass are charged to the prompt tokens), and the whole pass, f + a x W with
its decode rows, at most PASS_BOUND x the target (a short request arriving beside a long prompt waits for
about two passes: the one in flight and its own). Charging f and the decode rows to the target (the model
before, seconds ~ a x W, the whole pass at most the target) left the 16-token floor wherever a 16-row
decode pass alone took most of the target: on the 2-core CPU of 2026-11-30 (a decode pass ~0.15-0.2 s)
c=16 served 0.64x of main c9206fd's throughput. The chunk's time alone, without the whole pass's bound,
let passes beside a 6k-token prompt's late chunks (f ~1 s there: every padded row reads the whole span)
grow to 1-3 s, and a canary beside it waited 2.2 s (p50).

Only long prompts are paced (AdmissionPolicy.tokens_for): a pass whose prompts are all short, each whole
prompt within max_prefill_tokens, takes max_prefill_tokens. Such a pass starts at position 0 and its cost
is bounded by the fixed budget's; pacing it too cut c=16's passes on the 2-core CPU to about one 78-token
prompt where the 128-token budget took 1.3-1.5 (issue 37).
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Any, Sequence

DEFAULT_CONTEXT_WEIGHT = 4096.0
WINDOW = 16  # recent passes the model is fitted to
DISTINCT = 1.25  # two passes' work must differ by this factor for their slope to count
PASS_BOUND = 2.0  # a whole pass (its fixed cost and decode rows too) at most this many targets


def context_weight(model: Any) -> float:
    """C: a token's matmul work in units of one context position of attention (the 4 x heads x
    head_dim multiply-adds per layer of q.k and p.v), from the model's `args`; a default when its shape
    is not the usual one."""
    args = getattr(model, "args", None)
    try:
        d, ff = int(args.hidden_size), int(args.intermediate_size)
        heads = int(args.num_attention_heads)
        kv = int(getattr(args, "num_key_value_heads", None) or heads)
        hd = int(getattr(args, "head_dim", None) or d // heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return DEFAULT_CONTEXT_WEIGHT
    linear = 2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ff  # q, o, k, v and a gated MLP
    return max(1.0, linear / (2 * heads * hd))


def pass_work(weight: float, starts: Sequence[int], lengths: Sequence[int], contexts: Sequence[int] = ()) -> float:
    """W of a pass: chunks of `lengths` tokens from `starts`, and decode rows at `contexts`."""
    chunks = sum(n * (weight + s + n / 2) for s, n in zip(starts, lengths))
    return chunks + sum(weight + c for c in contexts)


def theil_sen(points: Sequence[tuple[float, float]]) -> float | None:
    """The median slope between pairs of (work, seconds) whose work differs by DISTINCT or more; None
    without such a pair."""
    slopes = [(s2 - s1) / (w2 - w1) for i, (w1, s1) in enumerate(points) for w2, s2 in points[i + 1:]
              if max(w1, w2) >= DISTINCT * min(w1, w2)]
    return median(slopes) if slopes else None


class PrefillPacer:
    """The token budget of the next prefill pass (at most `max_tokens`, at least `least`) whose chunks
    cost `target_s` of its time; `target_s` 0 turns pacing off (always `max_tokens`)."""

    def __init__(self, target_s: float, max_tokens: int, weight: float, least: int = 16) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.weight = weight
        self.least = min(least, max_tokens)
        self.seconds_per_unit = 0.0  # a; 0 until a pass was measured
        self.fixed_s = 0.0  # f
        self.passes = 0
        self.learning = True  # off: passes are not measured (a tensor-parallel rank's warm-up: distributed.freeze_clock)
        self._points: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (W, seconds) of recent passes

    def predict(self, work: float) -> float:
        """Seconds of a pass of work W by the model as learned so far (0 before any pass)."""
        return self.fixed_s + self.seconds_per_unit * work if self.seconds_per_unit else 0.0

    def observe(self, seconds: float, starts: Sequence[int], lengths: Sequence[int],
                contexts: Sequence[int] = ()) -> None:
        """A pass of chunks of `lengths` tokens from `starts` (beside decode rows at `contexts`) took `seconds`."""
        work = pass_work(self.weight, starts, lengths, contexts)
        if not self.target_s or not self.learning or work <= 0 or seconds <= 0:
            return
        self._points.append((work, seconds))
        points = list(self._points)
        slope = theil_sen(points)
        most = max(s / w for w, s in points)  # a larger slope would make some pass's f negative
        if slope is not None and slope > 0:
            self.seconds_per_unit = min(slope, most)
        elif not self.seconds_per_unit:
            self.seconds_per_unit = median(s / w for w, s in points)
        self.fixed_s = max(0.0, median(s - self.seconds_per_unit * w for w, s in points))
        self.passes += 1

    def budget(self, start: int, contexts: Sequence[int] = ()) -> int:
        """Tokens the next pass may prefill, its chunks starting at positions up to `start`, beside decode
        rows at `contexts` (a mixed pass): the largest T with a x T x (C + start + T/2) <= target (the chunk's
        own time) and f + a x (that + the decode rows' W) <= PASS_BOUND x target (the whole pass)."""
        if not self.target_s or not self.seconds_per_unit:
            return self.max_tokens
        decode = pass_work(self.weight, (), (), contexts)
        whole = (PASS_BOUND * self.target_s - self.fixed_s) / self.seconds_per_unit - decode
        units = min(self.target_s / self.seconds_per_unit, max(0.0, whole))
        base = self.weight + start
        tokens = math.sqrt(base * base + 2 * units) - base  # T^2 / 2 + base x T = units
        return max(self.least, min(self.max_tokens, int(tokens)))

    def stats(self) -> dict[str, float]:
        return {"target_s": self.target_s, "seconds_per_unit": self.seconds_per_unit, "fixed_s": self.fixed_s,
                "passes": self.passes}
