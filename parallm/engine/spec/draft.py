"""The draft-model proposer (spec.mode draft): a smaller model sharing the target's vocabulary proposes
k tokens for every speculating row, batched across rows, from its own KV rows (draft_kv.py).

A proposal is built lazily and read back only with the target's verify pass built on it; each pass's
tokens go to the device as soon as they are built (mx.async_eval), so it runs the pass while the host
builds the next one and the verify pass. The rows catch up (each from its own computed length to the
sequence's last token; a row more than `BATCHED_LAG` tokens behind, a new one, is prefilled alone first
in chunks), then k - 1 single-token passes feed the draft's own proposals. Each proposed token is the argmax of the draft's
processed distribution q (the row's own temperature, top-k/p, min-p, logit bias, min_tokens: the decode
sampler's processing, sampling.Sampler.process), plus Gumbel noise for a sampled row:
- coupled (spec.draft_acceptance, the default): the very noise the target's sampler adds at that output
  position of that request (sampling.py: a function of the sequence's seed and the position alone), so
  the draft proposes argmax(q's logits + g) where the target will sample argmax(p's logits + g); the
  closer q is to p, the likelier they agree, and the verify pass accepts while they do;
- rejection: noise of its own stream (the seed salted: independent of the target's), a sample of q;
  the verify pass (draft_verify.py) needs q itself, so the proposal keeps it for sampled rows.

The draft runs base weights: a LoRA row's adapter is the target's alone (it verifies under it).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import mlx.core as mx
import mlx.nn as nn

from ..compat import ModelInfo
from ..sampling import BatchParams, Sampler, gumbel_noise, noise_key
from ..sequence import Sequence
from .draft_kv import DraftKV

BATCHED_LAG = 8  # rows at most this many tokens behind catch up in the batched pass
CHUNK = 512  # a lagging row's catch-up pass length
DRAFT_SALT = 0x5EC0D4A1F7  # the draft's sampling noise under rejection: the row's seed xor this


@dataclass(slots=True)
class Proposal:
    """Row r of the proposal is seqs[r]'s: `tokens` [m, kmax] (row r's first ks[r] are its proposal),
    `probs` [m, kmax, V] the draft's distributions they were drawn from (None when every row is greedy or
    the proposal is coupled),
    `lengths` each row's sequence length when proposed."""

    seqs: list[Sequence]
    ks: list[int]
    tokens: mx.array
    probs: mx.array | None
    lengths: list[int]

    @property
    def kmax(self) -> int:
        return max(self.ks)


class DraftProposer:
    def __init__(self, model: nn.Module, info: ModelInfo, vocab_size: int, eos_ids: list[int],
                 compiled: bool = True, coupled: bool = True, context: ContextManager | None = None) -> None:
        """`vocab_size`: the target's logits width (the draft's are cut or padded with -inf to it); `coupled`:
        sampled rows propose with the target's own noise (spec.draft_acceptance coupled) instead of their own;
        `context`: what the draft's passes run under (the engine's attention and fast-math stand-ins for the
        draft's module, fastmath.FastMath; None: mlx-lm's own functions)."""
        self.model = model
        self.context = context if context is not None else nullcontext()
        self.info = info
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.coupled = coupled
        self.kv = DraftKV(info)
        self.sampler = Sampler(vocab_size, compiled=compiled)
        self.prefill_tokens = 0  # tokens the draft caught up on outside the batched pass

    def propose(self, seqs: list[Sequence], ks: list[int], keep: list[int] = ()) -> Proposal:
        """Up to ks[i] >= 1 tokens for seqs[i] (every row proposes max(ks); row i's first ks[i] count);
        `keep`: sequences whose draft rows stay although they do not propose now (resting rows).
        Builds the graph; the caller evaluates it (with the verify pass)."""
        kmax = max(ks)
        kv = self.kv
        kv.arrange([s.seq_id for s in seqs], max(s.num_tokens for s in seqs) + max(kmax, BATCHED_LAG) + 1, keep)
        self._catch_up_alone(seqs)
        lengths = [s.num_tokens for s in seqs]
        starts = [kv.length(s.seq_id) for s in seqs]
        lags = [n - st for n, st in zip(lengths, starts)]
        L = max(lags)
        rows = [s.token_ids[st:] + [0] * (L - lag) for s, st, lag in zip(seqs, starts, lags)]
        logits = self._run(mx.array(rows, dtype=mx.int32), kv.views(starts, L))
        logits = logits[mx.arange(len(seqs)), mx.array([lag - 1 for lag in lags], dtype=mx.int32)]
        bp = BatchParams(seqs, self.eos_ids, self.vocab_size)
        tokens, probs = [], []
        for j in range(kmax):
            positions = [s.num_output + j for s in seqs]
            z = self.sampler.process(self._fit(logits), bp, positions)
            if bp.any_sampled:
                salt = 0 if self.coupled else DRAFT_SALT  # coupled: the key the target's sampler uses there
                noise = gumbel_noise([noise_key(s.seed ^ salt, p) for s, p in zip(seqs, positions)],
                                     self.vocab_size, compiled=self.sampler.compiled)
                tok = mx.argmax(z + noise * bp.noise_on, axis=-1).astype(mx.int32)
                if not self.coupled:
                    probs.append(mx.softmax(z, axis=-1))
            else:
                tok = mx.argmax(z, axis=-1).astype(mx.int32)
            tokens.append(tok)
            mx.async_eval(tok)  # the device runs this pass while the next one (or the verify pass) is built
            if j + 1 < kmax:
                logits = self._run(tok[:, None], kv.views([n + j for n in lengths], 1))[:, -1]
        for s, n in zip(seqs, lengths):
            kv.advance(s.seq_id, n + kmax - 1)
        return Proposal(list(seqs), list(ks), mx.stack(tokens, axis=1),
                        mx.stack(probs, axis=1) if probs else None, lengths)

    def accepted(self, prop: Proposal, row: int, accepted: int) -> None:
        """Row `row` of `prop` had this many proposed tokens accepted: its draft row keeps them (those it
        computed) and drops the rest."""
        self.kv.rollback(prop.seqs[row].seq_id, prop.lengths[row] + min(accepted, prop.kmax - 1))

    def _catch_up_alone(self, seqs: list[Sequence]) -> None:
        """Prefill each row more than BATCHED_LAG tokens behind up to its last token but one, alone and
        in chunks (a new row would otherwise pad every row of the batched pass to its prompt); an n > 1
        sibling of a row that holds the prompt copies it instead."""
        kv = self.kv
        prompted: dict[str, int] = {}  # rid -> a sequence of it whose row holds the whole prompt
        for i, s in enumerate(seqs):
            start, end = kv.length(s.seq_id), s.num_tokens - 1
            sibling = prompted.get(s.rid)
            if sibling is not None and start < s.num_prompt and end - start > BATCHED_LAG:
                start = min(s.num_prompt, kv.length(sibling))
                kv.fork(sibling, s.seq_id, start)  # n > 1: the prompt is the siblings' own
            if kv.length(s.seq_id) >= s.num_prompt or end - start > BATCHED_LAG:
                prompted.setdefault(s.rid, s.seq_id)
            if end - start <= BATCHED_LAG:
                continue
            ids = s.token_ids
            while start < end:
                n = min(CHUNK, end - start)
                self._run(mx.array([ids[start:start + n]], dtype=mx.int32), kv.views([start], n, row0=i))
                mx.eval(kv.arrays())  # the K/V only: the logits of these positions are never computed
                start += n
                self.prefill_tokens += n
            kv.advance(s.seq_id, end)

    def _run(self, tokens: mx.array, cache: list) -> mx.array:
        with self.context:
            return self.model(tokens, cache=cache)

    def _fit(self, logits: mx.array) -> mx.array:
        """The draft's logits [B, V_draft] as [B, V_target] float32: cut, or padded with -inf."""
        l = logits.astype(mx.float32)
        d = l.shape[-1] - self.vocab_size
        if d > 0:
            return l[:, :self.vocab_size]
        if d < 0:
            return mx.concatenate([l, mx.full((l.shape[0], -d), float("-inf"))], axis=-1)
        return l

    def forget(self, key: int) -> None:
        self.kv.forget(key)

    def reset(self) -> None:
        """No rows (warm-up's sequences are not the server's)."""
        self.kv = DraftKV(self.info)
        self.prefill_tokens = 0
