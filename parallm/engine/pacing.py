"""Prefill pacing: how many prompt tokens the next prefill pass may take so that it lasts about
`engine.prefill_pass_s`, measured on this machine, this model.

A fixed token budget bounds a pass's tokens, not its time: on the 2-core CPU one 128-token chunk of
a 6k-token prompt took seconds near its end (attention over the whole context), and a short prompt
that arrived meanwhile waited for that pass, then shared the next one with the next chunk, then decoded
beside the one after (issue 30: a 2-token completion took 14.4 s while a 6k prompt prefilled).
vLLM bounds this with `long_prefill_token_threshold` (a long prompt's chunk is at most that many tokens
while others wait); tokens are a poor proxy when a chunk's cost grows with its position, so here the
budget follows a time target instead.

Cost model: a pass's seconds ~ a x W, with W summed over its rows, a chunk of `n` tokens at positions
s .. s+n counting n x (C + s + n/2) (per-token matmul work C, in units of one position of attention
context) and a decode row at context c counting C + c. C comes from the model's shape
(`context_weight`); `a` is learned from the passes as they run (an exponential average of seconds / W,
one observation moving it at most 2x, so one stalled pass cannot collapse the budget). A fixed cost per
pass is not modelled: it is attributed to the tokens, which makes the estimate high for short chunks, and
the budget's fixed point is still the chunk whose measured time is the target.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

DEFAULT_CONTEXT_WEIGHT = 4096.0
SMOOTHING = 0.3  # weight of a new observation in the average of seconds per unit of work


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


class PrefillPacer:
    """The token budget of the next prefill pass (at most `max_tokens`, at least `least`) for a pass
    lasting `target_s`; `target_s` 0 turns pacing off (always `max_tokens`)."""

    def __init__(self, target_s: float, max_tokens: int, weight: float, least: int = 16) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.weight = weight
        self.least = min(least, max_tokens)
        self.seconds_per_unit = 0.0  # a; 0 until a pass was measured
        self.passes = 0
        self.learning = True  # off: passes are not measured (a tensor-parallel rank's warm-up: distributed.freeze_clock)

    def observe(self, seconds: float, starts: Sequence[int], lengths: Sequence[int],
                contexts: Sequence[int] = ()) -> None:
        """A pass of chunks of `lengths` tokens from `starts` (beside decode rows at `contexts`) took `seconds`."""
        work = pass_work(self.weight, starts, lengths, contexts)
        if not self.target_s or not self.learning or work <= 0 or seconds <= 0:
            return
        rate = seconds / work
        if self.seconds_per_unit:
            rate = min(max(rate, self.seconds_per_unit / 2), self.seconds_per_unit * 2)
            rate = (1 - SMOOTHING) * self.seconds_per_unit + SMOOTHING * rate
        self.seconds_per_unit = rate
        self.passes += 1

    def budget(self, start: int, contexts: Sequence[int] = ()) -> int:
        """Tokens the next pass may prefill, its chunks starting at positions up to `start`, beside
        decode rows at `contexts` (a mixed pass): the largest T with a x (T x (C + start + T/2) +
        decode rows) <= target."""
        if not self.target_s or not self.seconds_per_unit:
            return self.max_tokens
        units = self.target_s / self.seconds_per_unit - pass_work(self.weight, (), (), contexts)
        base = self.weight + start
        tokens = math.sqrt(base * base + 2 * max(0.0, units)) - base  # T^2 / 2 + base x T = units
        return max(self.least, min(self.max_tokens, int(tokens)))

    def stats(self) -> dict[str, float]:
        return {"target_s": self.target_s, "seconds_per_unit": self.seconds_per_unit, "passes": self.passes}
