"""The admission policy, pure: the shape of a step's prefill pass over the prefill region, whether
a waiting sequence may join it, and which sequence a better-priority one may preempt for rows or
memory. The Scheduler asks; nothing here changes its state (docs/scheduling.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .plan import KVBudget, length_bucket
from .priority import PriorityPolicy
from .sequence import Sequence


@dataclass(slots=True)
class PassShape:
    """A prefill pass over a region in priority order: its first `top` rows are of the best
    effective priority and share the budget of `tokens`, the pass takes the first `k` rows, chunks of
    at most `length` tokens, every row padded to `padded` (`length`, or its bucket: plan.length_bucket)."""

    top: int
    k: int
    length: int
    padded: int
    tokens: int


class AdmissionPolicy:
    def __init__(self, *, budget: KVBudget, max_prefill_tokens: int, headroom: int, priority: PriorityPolicy,
                 buckets: bool = False) -> None:
        self.budget = budget
        self.buckets = buckets  # pad a pass's length to its bucket (engine.prefill_buckets)
        self.max_prefill_tokens = max_prefill_tokens
        self.pass_tokens = max_prefill_tokens  # this step's budget: max_prefill_tokens, or less when paced (pacing.py)
        self.headroom = headroom
        self.priority = priority
        # whether `seq` fits the block store once the sequences given were preempted (the Scheduler's)
        self.memory_fits: Callable[[Sequence, list[Sequence]], bool] | None = None

    def chunk_len(self, remaining: list[int], tokens: int) -> int:
        """The padded chunk length L of a prefill pass of `tokens` (its budget: tokens_for) over rows with
        these remaining tokens."""
        if not remaining:
            return 0
        return min(max(remaining), max(1, tokens // len(remaining)))

    def tokens_for(self, region: list[Sequence]) -> int:
        """The budget of a pass over `region`: max_prefill_tokens where every prompt in it is short (the
        whole prompt, cached part included, within max_prefill_tokens), else the step's paced budget.
        vLLM's `long_prefill_token_threshold` in this engine's terms: the pacer (pacing.py) bounds the time
        of a long prompt's chunks, whose cost grows with their position; short prompts start at position 0
        and finish in the pass, and pacing them too cut a pass to about one 78-token prompt where the fixed
        128-token budget took 1.3-1.5 (c=16 on the 2-core CPU, docs/scheduling.md)."""
        if all(s.prefill_target <= self.max_prefill_tokens for s in region):
            return self.max_prefill_tokens
        return self.pass_tokens

    def pass_shape(self, region: list[Sequence], rems: list[int], now: float) -> PassShape:
        """Equal priorities: every row, as many tokens each as the budget allows. Otherwise the
        best priority's rows share the budget, and worse rows ride along only while k x L stays
        within it and each fills half its chunk."""
        tokens = self.tokens_for(region)
        if not self.priority.mixed(region):
            length = self.chunk_len(rems, tokens)
            return PassShape(len(region), len(region), length, self._padded(length), tokens)
        effs = [self.priority.effective(s, now) for s in region]
        top = 1
        while top < len(region) and effs[top] == effs[0]:
            top += 1
        length = self.chunk_len(rems[:top], tokens)
        k = top
        while k < len(region) and (k + 1) * length <= tokens and 2 * min(rems[k], length) >= length:
            k += 1
        return PassShape(top, k, length, self._padded(length), tokens)

    def _padded(self, length: int) -> int:
        return length_bucket(length, self.max_prefill_tokens) if self.buckets and length else length

    def capacity(self, running: list[Sequence], starts: list[int], shape: PassShape) -> int:
        """Token slots per row the next passes write: decode at num_computed; a prefill row in the
        pass writes its whole padded chunk (to the bucket's length) (pad positions are overwritten later, never attended);
        rows outside the pass keep what they hold."""
        need = max((s.num_computed + 1 for s in running), default=0)
        if shape.k:
            need = max(need, max(starts[:shape.k]) + shape.padded + 1)
        return max([need] + starts[shape.k:])

    def with_candidate(self, prefilling: list[Sequence], seq: Sequence, remaining: int,
                       cached: int, now: float) -> tuple[list[Sequence], list[int], list[int]]:
        """The prefill region (sequences, remaining tokens, starts) as it would be with `seq` in it:
        appended, then in priority order (stable) when priorities differ."""
        region = prefilling + [seq]
        rems = [s.prefill_remaining for s in prefilling] + [remaining]
        starts = [s.num_computed for s in prefilling] + [cached]
        if self.priority.mixed(region):
            order = sorted(range(len(region)), key=lambda j: self.priority.effective(region[j], now))
            region, rems, starts = [region[j] for j in order], [rems[j] for j in order], [starts[j] for j in order]
        return region, rems, starts

    def refuses_pass(self, pos: int, rems: list[int], shape: PassShape) -> bool:
        """Whether the row at `pos` of a candidate region must wait: a better prompt is being
        prefilled, or joining would not be worth it. A row joins a pass only if the pass's chunk stays
        long enough to take its prompt (or what the others of its priority would get without it), and
        if its chunk fills at least half the padded length, except for fair prefill: a short prompt
        that finishes in this pass joins one whose other rows are long prompts being chunked, as long
        as they keep half the budget. Without that exception a 6k-token prompt held every new request
        for 63 s on a CPU (issue 30): each of its chunks took the whole budget."""
        if pos >= shape.top:
            return True
        remaining, length = rems[pos], shape.length
        others = rems[:pos] + rems[pos + 1:shape.top]
        if not others:
            return False
        tokens = shape.tokens
        if length < min(remaining, self.chunk_len(others, tokens)):
            return True
        if 2 * min(remaining, length) >= length:
            return False
        chunked = all(r > self.chunk_len(others, tokens) for r in others)  # the others alone would not finish this pass
        return not (chunked and length >= tokens // 2)

    def victim(self, seq: Sequence, pool: list[Sequence], rows_in_use: int, live: list[Sequence], now: float,
               check_memory: bool = True) -> Sequence | None:
        """Whom `seq` may preempt from `pool`: the worst (newest among equals) of strictly worse
        effective priority, provided that preempting all of those would make room (rows, and with
        `check_memory` the KV budget); None if no one."""
        eff = self.priority.effective(seq, now)
        worse = [s for s in pool if self.priority.effective(s, now) > eff]
        if not worse or (check_memory and not self._fits_without(seq, worse, rows_in_use, live)):
            return None
        return max(worse, key=lambda s: self.priority.key(s, now))

    def _fits_without(self, seq: Sequence, gone: list[Sequence], rows_in_use: int, live: list[Sequence]) -> bool:
        rows = rows_in_use - sum(_rows_of(s) for s in gone) + _rows_of(seq)
        stay = [s.num_computed + 1 for s in live if s not in gone]
        need = max(stay + [seq.num_tokens + self.headroom])
        if not self.budget.fits(rows, min(need, self.budget.max_len)):
            return False
        return self.memory_fits is None or self.memory_fits(seq, gone)


def _rows_of(seq: Sequence) -> int:
    """Rows a sequence holds or needs: its own, and its n > 1 siblings' until they are forked."""
    return 1 + (len(seq.group.followers) if seq.group is not None and seq.group.leader is seq else 0)
