"""The verification pass: one target forward over every running row, a speculating row's last token
and its proposal, every other row's last token alone (padded), sampled as a decode pass samples.

Exactness. Position j of a row holds the target's logits after the row's tokens and the first j
proposed ones. Each position is sampled by the decode sampler with the row's own parameters and the
noise of its own output position (sampling.py: Gumbel-max, a pure function of the sequence's seed and
the position), so the token it gives is the token the row would sample there without speculation.
Proposed token j+1 is accepted while it equals the target's sample at position j; the first mismatch
emits the target's sample instead, and a row that accepts all emits the sample after them too. The
emitted tokens are therefore those of plain decoding, whatever was proposed: greedy rows match
argmax, sampled rows keep the target's processed distribution (for a proposal of one token d this is
rejection sampling's rule: d is accepted with probability p(d), and a rejection emits a token drawn
from p restricted to the others, as the residual max(0, p - q) normalized says), the same seed gives
the same tokens, and the logprobs are the target's, of the distribution sampled from.

Position 0 goes through the decode path whole (penalties, grammar masks, logit bias, min_tokens);
positions after it only for rows the speculator lets speculate, which use no processor whose state
moves with the tokens (penalty counts, grammar state), so the sampler applies theirs exactly there.

Rejected positions: the pass wrote K/V for all L positions of every row; the row keeps the accepted
ones (`ModelRunner.rollback`): its length (num_computed); the blocks the scheduler gave its table for
the draft (`RowLayout.reserve`) go back past the next token's (`RowLayout.truncate`), and a rejected
position left in a kept block is never attended and is overwritten by the next pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..pass_view import PassContext
from ..runner import ModelRunner
from ..sampling import BatchParams, SampledLists
from ..sequence import Sequence


@dataclass(slots=True)
class Verified:
    """A verification pass read back: `first` row i is seqs[i]'s sample at position 0; `rest` holds the
    samples at positions 1 .. len(drafts[i]) of the speculating rows, row i's from `starts[i]` on."""

    first: SampledLists
    rest: SampledLists | None
    starts: list[int]

    def emitted(self, i: int, draft: list[int]) -> list[tuple[SampledLists, int]]:
        """Row i's tokens, as (sampled columns, index) pairs: its position-0 sample, then each next
        position's sample while the previous sample equals the proposed token there."""
        out = [(self.first, i)]
        tok = self.first.tokens[i]
        for j, proposed in enumerate(draft):
            if tok != proposed:
                break
            at = self.starts[i] + j
            out.append((self.rest, at))
            tok = self.rest.tokens[at]
        return out


def verify(runner: ModelRunner, seqs: list[Sequence], drafts: list[list[int]]) -> Verified:
    """Run rows [0, len(seqs)) over [last token] + drafts[i] (padded to the longest) from each row's
    length on, sample every position a row needs, and wait for it. Nothing may be in flight (the
    rows' last tokens are read back): the caller drains the overlapped schedule first."""
    L = 1 + max(len(d) for d in drafts)
    tokens = mx.array([[s.last_token, *d] + [0] * (L - 1 - len(d)) for s, d in zip(seqs, drafts)], dtype=mx.int32)
    _, first, rest, starts = target_pass(runner, seqs, tokens, [len(d) for d in drafts])
    runner.live.settle()
    mx.eval(first.arrays(), rest.arrays() if rest else [], runner.penalties.arrays(), runner.live.arrays())
    return Verified(first.read(), rest.read() if rest else None, starts)


def target_pass(runner: ModelRunner, seqs: list[Sequence], tokens: mx.array,
                counts: list[int]) -> tuple[mx.array, SampledLists, SampledLists | None, list[int]]:
    """The target's one pass over `tokens` ([rows, 1 + longest proposal]: each row's last token, then its
    proposal, padded) from each row's length on, and its samples, not yet evaluated: the logits, the
    position-0 samples, and the samples at positions 1 .. counts[i] of every row (row i's from starts[i] on).
    Shared by the n-gram verify and the draft verify."""
    L = tokens.shape[1]
    offsets = [s.num_computed for s in seqs]
    assert max(offsets) + L <= runner.live.capacity, "a verify pass past the live rows' capacity"
    ctx = PassContext(0, offsets, L, max(offsets) + L, mask5d=runner.info.mask5d, tables=[s.block_ids for s in seqs])
    job = runner._mask_job(seqs)  # grammar masks of position 0 (filled while the graph is built)
    logits = runner._forward(seqs, tokens, runner.live.views(ctx))
    bitmask = None if job is None else mx.array(job.result())
    first = runner._sample_rows(seqs, logits[:, 0, :], [s.num_output for s in seqs], bitmask)
    rows, cols, flat_seqs, positions, starts = [], [], [], [], []
    for i, (s, k) in enumerate(zip(seqs, counts)):
        starts.append(len(rows))
        for j in range(1, k + 1):
            rows.append(i)
            cols.append(j)
            flat_seqs.append(s)
            positions.append(s.num_output + j)
    rest = None
    if rows:
        picked = logits[mx.array(rows, dtype=mx.int32), mx.array(cols, dtype=mx.int32)]
        rest = runner.sampler.sample(picked, BatchParams(flat_seqs, runner.eos_ids, runner.vocab_size), positions)
    return logits, first, rest, starts
