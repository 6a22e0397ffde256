"""The verification pass of draft proposals (spec.mode draft): one target forward over every running
row, a speculating row's last token and its k proposed tokens, every other row's last token alone
(padded), built on the draft's graph and read back once.

Exactness (Leviathan et al. 2023, Chen et al. 2023). At position j of a speculating row the target's
processed distribution p_j (the decode sampler's: the row's temperature, filters, logit bias,
min_tokens; such a row has no penalty and no grammar, decoder.py) is compared with the draft's q_j,
the distribution its token x was drawn from:
- a greedy row accepts x while it is the target's argmax; the first other position emits the argmax;
- a sampled row under spec.draft_acceptance coupled (the default) is verified as a greedy one, against
  the target's own sample: the draft proposed x = argmax(q's logits + g) with the noise g the target's
  sampler adds at that position for that request (draft.py), the target's sample there is
  argmax(p's logits + g); x is accepted while it equals that sample and the first other position emits
  the sample, so every emitted token is the one plain decoding draws for the seed (n-gram mode's rule,
  verify.py), whatever the batch and whether the step speculated;
- a sampled row under rejection accepts x with probability min(1, p_j(x) / q_j(x)) (a uniform of the
  row's seed and output position, salted), and the first rejection emits a token drawn from the
  residual max(0, p_j - q_j), normalized (Gumbel-max with its own salted noise), so every emitted token
  is distributed as p_j given the tokens before it;
- a row that accepts all k emits the target's own sample at position k (the decode sampler's noise),
  and a row without a proposal emits its position-0 sample (penalties, grammar masks and all).
The logprobs reported are the target's, log p_j of the emitted token, with position j's top
alternatives. A greedy row, and a sampled row under coupled acceptance, emits exactly what it emits
without speculation; under rejection a sampled row's tokens have the target's distribution but, for a
given seed, are not those of plain decoding (the acceptance test draws other noise than the target's
sampler), at a higher acceptance: rejection accepts a position with probability sum_x min(p(x), q(x))
= 1 - TV(p, q), the most any coupling of p and q can agree; the shared Gumbel noise's agreement is at
most that.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..runner import ModelRunner
from ..sampling import BatchParams, SampledLists, gumbel_noise, log_softmax, noise_key
from ..sequence import Sequence
from .draft import Proposal
from .verify import target_pass

ACCEPT_SALT = 0xACC3F7C0DE  # the acceptance test's uniforms: the row's seed xor this
RESIDUAL_SALT = 0x2E51D0A1B9  # the residual's Gumbel noise


@dataclass(slots=True)
class DraftVerified:
    """A verification pass read back. `first` row i: seqs[i]'s sample at position 0; `rest`: the
    target's samples at positions 1 .. k of the speculating rows (row i's from starts[i] on); per
    tested proposal (flat, row i's from `tested[i]` on): whether it was accepted, the residual's token
    and the target's logprobs of the proposal and of that token."""

    first: SampledLists
    rest: SampledLists | None
    starts: list[int]
    tested: list[int]
    proposed: list[list[int]]  # the draft's tokens, per draft row
    accept: list[bool] | None
    residual: list[int] | None
    lp_proposed: list[float] | None
    lp_residual: list[float] | None

    def _at(self, i: int, j: int) -> tuple[SampledLists, int]:
        """The target's own sample of row i at position j."""
        return (self.first, i) if j == 0 else (self.rest, self.starts[i] + j - 1)

    def emitted(self, i: int, k: int, r: int | None, rejection: bool) -> list[tuple[SampledLists, int]]:
        """Row i's tokens as (sampled columns, index) pairs; `k` its proposal's length, `r` its draft row,
        `rejection`: its proposal was tested by rejection sampling (else it is matched against the target's
        own samples)."""
        if not k:
            return [(self.first, i)]
        out = []
        for j in range(k):
            x = self.proposed[r][j]
            std, at = self._at(i, j)
            if not rejection:
                out.append((std, at))
                if std.tokens[at] != x:
                    return out
                continue
            f = self.tested[i] + j
            if self.accept[f]:
                out.append((_one(x, self.lp_proposed[f], std, at), 0))
                continue
            out.append((_one(self.residual[f], self.lp_residual[f], std, at), 0))
            return out
        out.append(self._at(i, k))
        return out


def _one(token: int, logprob: float, std: SampledLists, at: int) -> SampledLists:
    """One emitted token with its logprob and the position's top alternatives (those of `std` row `at`)."""
    return SampledLists([token], [logprob], None if std.top_ids is None else [std.top_ids[at]],
                        None if std.top_logprobs is None else [std.top_logprobs[at]])


def _uniform(keys: list[int]) -> mx.array:
    """One uniform in (0, 1) per key (the CDF of one standard Gumbel draw)."""
    return mx.exp(-mx.exp(-gumbel_noise(keys, 1)[:, 0]))


def verify_draft(runner: ModelRunner, seqs: list[Sequence], ks: list[int], prop: Proposal,
                 draft_row: list[int | None], rejection: bool = False) -> DraftVerified:
    """Run rows [0, len(seqs)) over [last token] + their proposal (row i: ks[i] tokens of draft row
    draft_row[i]; 0 and None: no proposal), padded to 1 + prop.kmax, sample every position a row needs
    (and, with `rejection`, test a sampled row's proposals by rejection sampling against prop.probs), and
    wait for it (the draft's graph included). Nothing may be in flight."""
    src = mx.array([r if r is not None else 0 for r in draft_row], dtype=mx.int32)
    has = mx.array([[r is not None] for r in draft_row])
    proposed = mx.where(has, prop.tokens[src], 0)
    tokens = mx.concatenate([mx.array([[s.last_token] for s in seqs], dtype=mx.int32), proposed], axis=1)
    logits, first, rest, starts = target_pass(runner, seqs, tokens, ks)
    tested, test = [], None
    t_rows, t_cols, t_seqs, t_pos, d_rows = [], [], [], [], []
    for i, (s, k, r) in enumerate(zip(seqs, ks, draft_row)):
        tested.append(len(t_rows))
        if rejection and k and s.params.temperature > 0:
            for j in range(k):
                t_rows.append(i)
                t_cols.append(j)
                t_seqs.append(s)
                t_pos.append(s.num_output + j)
                d_rows.append(r)
    if t_rows:
        test = _test(runner, logits, prop, t_rows, t_cols, t_seqs, t_pos, d_rows)
    runner.live.settle()
    mx.eval(first.arrays(), rest.arrays() if rest else [], runner.penalties.arrays(), runner.live.arrays(),
            prop.tokens, test or [])
    got = [a.tolist() for a in test] if test else [None] * 4
    return DraftVerified(first.read(), rest.read() if rest else None, starts, tested, prop.tokens.tolist(),
                         got[0], got[1], got[2], got[3])


def _test(runner: ModelRunner, logits: mx.array, prop: Proposal, rows: list[int], cols: list[int],
          seqs: list[Sequence], positions: list[int], d_rows: list[int]) -> list[mx.array]:
    """Rejection sampling at the flat positions (row, col) of sampled rows: [accepted, residual token,
    log p(proposed), log p(residual token)]."""
    at = (mx.array(rows, dtype=mx.int32), mx.array(cols, dtype=mx.int32))
    z = runner.sampler.process(logits[at], BatchParams(seqs, runner.eos_ids, runner.vocab_size), positions)
    lp = log_softmax(z)
    p = mx.exp(lp)
    d_at = (mx.array(d_rows, dtype=mx.int32), mx.array(cols, dtype=mx.int32))
    q = prop.probs[d_at]
    x = prop.tokens[d_at][:, None]
    px = mx.take_along_axis(p, x, axis=-1)[:, 0]
    qx = mx.take_along_axis(q, x, axis=-1)[:, 0]
    u = _uniform([noise_key(s.seed ^ ACCEPT_SALT, pos) for s, pos in zip(seqs, positions)])
    accept = u * qx < px
    residual = mx.maximum(p - q, 0.0)
    noise = gumbel_noise([noise_key(s.seed ^ RESIDUAL_SALT, pos) for s, pos in zip(seqs, positions)],
                         runner.vocab_size, compiled=runner.sampler.compiled)
    from_residual = mx.argmax(mx.log(residual) + noise, axis=-1)
    from_p = mx.argmax(z + noise, axis=-1)  # p = q to rounding: the residual is empty, p itself
    token = mx.where(residual.sum(axis=-1) > 0, from_residual, from_p).astype(mx.int32)
    return [accept, token, lp[mx.arange(len(rows)), x[:, 0]], mx.take_along_axis(lp, token[:, None], axis=-1)[:, 0]]
