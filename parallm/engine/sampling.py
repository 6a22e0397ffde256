"""Batched per-row sampling: penalties, logit bias, temperature, top-k/top-p/min-p, seeds, logprobs.

Every vocab-sized operation runs once over the whole batch; per-row parameters are small
arrays rebuilt only when the batch composition changes. When every row is greedy and nothing
else is asked for, a step is one argmax.

Seeds that batch: a row samples with the Gumbel-max trick, argmax(z + g), where the noise g of
vocab entry v at output position i is a pure function of (the sequence's seed, i, v): a
counter-based hash computed with MLX integer ops. So the same seed gives the same tokens
whatever else is in the batch, after preemption and recompute too, and n > 1 siblings use
seed + index. (Per-row mx.random keys would need one vocab-sized call per row.)

Logprobs are those of the distribution actually sampled from: z = processed logits / T with
the filtered tokens at -inf, normalized. At temperature 0, z = processed logits (no filters),
so the chosen token's logprob is the maximum.

Filter order: top-k, then top-p on what top-k kept, then min-p.

Grammar constraints (constraints.py) arrive as a [B, ceil(V/32)] int32 bitmask applied after
penalties, logit bias and min_tokens and before temperature and the filters: a disallowed token
is -inf, so the reported logprobs are those of the masked, temperature-scaled distribution. A
step without a mask does none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import mlx.core as mx

from .sequence import Sequence

MASK64 = (1 << 64) - 1
NEG_INF = float("-inf")


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """64-bit key of the noise for one (sequence seed, output position)."""
    return splitmix64(splitmix64(seed & MASK64) ^ (position & MASK64))


def _fmix32(h: mx.array) -> mx.array:
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, dtype=mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return h ^ (h >> 16)


def _gumbel(k1: mx.array, k2: mx.array, base: mx.array) -> mx.array:
    h = _fmix32(base[None, :] ^ k1[:, None])
    h = _fmix32(h + k2[:, None])
    # 23 bits so that u < 1 is exactly representable; u in (0, 1)
    u = ((h >> 9).astype(mx.float32) + 0.5) * (1.0 / 8388608.0)
    return -mx.log(-mx.log(u))


_gumbel_compiled = mx.compile(_gumbel)


def gumbel_noise(keys: Seq[int], vocab_size: int, *, compiled: bool = True) -> mx.array:
    """[len(keys), vocab_size] standard Gumbel noise, one deterministic row per key."""
    k1 = mx.array([k & 0xFFFFFFFF for k in keys], dtype=mx.uint32)
    k2 = mx.array([k >> 32 for k in keys], dtype=mx.uint32)
    return (_gumbel_compiled if compiled else _gumbel)(k1, k2, _base(vocab_size))


_BASES: dict[int, mx.array] = {}


def _base(vocab_size: int) -> mx.array:
    b = _BASES.get(vocab_size)
    if b is None:
        idx = mx.arange(vocab_size, dtype=mx.uint32)
        b = _fmix32(idx * mx.array(0x9E3779B1, dtype=mx.uint32) + mx.array(0x7F4A7C15, dtype=mx.uint32))
        mx.eval(b)
        _BASES[vocab_size] = b
    return b


def _penalize(logits: mx.array, counts: mx.array, seen: mx.array, rep: mx.array, pres: mx.array,
              freq: mx.array) -> mx.array:
    factor = 1.0 + seen * (rep - 1.0)  # HF repetition penalty over prompt + output
    logits = mx.where(logits > 0, logits / factor, logits * factor)
    return logits - pres * (counts > 0) - freq * counts  # OpenAI presence/frequency over output


_penalize_compiled = mx.compile(_penalize)


_SHIFTS = mx.arange(32, dtype=mx.uint32)


def _apply_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    bits = (bitmask.astype(mx.uint32)[:, :, None] >> _SHIFTS) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]] != 0
    return mx.where(allowed, logits, NEG_INF)


_apply_bitmask_compiled = mx.compile(_apply_bitmask)


def apply_bitmask(logits: mx.array, bitmask: mx.array, *, compiled: bool = True) -> mx.array:
    """`logits` [B, V] with every token whose bit is clear in `bitmask` [B, ceil(V/32)] at -inf."""
    return (_apply_bitmask_compiled if compiled else _apply_bitmask)(logits, bitmask)


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def top_of(lp: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Ids and values of the k largest entries per row (unordered; sorted on the host); k past the
    vocabulary is every entry."""
    k = min(k, lp.shape[-1])
    ids = mx.argpartition(-lp, k - 1, axis=-1)[..., :k]
    return ids, mx.take_along_axis(lp, ids, axis=-1)


def rank_of(lp: mx.array, chosen: mx.array) -> mx.array:
    """vLLM's rank of each row's token: how many entries of the row are >= its logprob (1 = the most likely)."""
    return (lp >= chosen[:, None]).sum(axis=-1)


@dataclass(slots=True)
class SampleOut:
    tokens: mx.array  # [B] int32
    logprobs: mx.array | None = None  # [B] logprob of each sampled token
    top_ids: mx.array | None = None  # [B, k]
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]

    def read(self) -> "SampledLists":
        """The sampled columns as Python lists (waits for the pass)."""
        return SampledLists(self.tokens.tolist(), None if self.logprobs is None else self.logprobs.tolist(),
                            None if self.top_ids is None else self.top_ids.tolist(),
                            None if self.top_logprobs is None else self.top_logprobs.tolist())


@dataclass(slots=True)
class SampledLists:
    """A SampleOut read back: one entry per row; None where the pass computed no such column."""

    tokens: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class BatchParams:
    """Per-row sampling parameters of one batch composition, as small arrays."""

    def __init__(self, seqs: list[Sequence], eos_ids: Seq[int], vocab_size: int) -> None:
        self.size = B = len(seqs)
        ps = [s.params for s in seqs]
        sampled = [p.temperature > 0 for p in ps]
        self.any_sampled = any(sampled)
        self.inv_temp = mx.array([[1.0 / p.temperature if p.temperature > 0 else 1.0] for p in ps])
        self.noise_on = mx.array([[1.0 if s else 0.0] for s in sampled])
        self.top_k = [min(p.top_k, vocab_size) if sp else 0 for p, sp in zip(ps, sampled)]
        self.kmax = max(self.top_k)
        self.top_k_arr = mx.array(self.top_k, dtype=mx.int32)
        self.top_p_rows = [i for i, (p, sp) in enumerate(zip(ps, sampled)) if sp and p.top_p < 1.0]
        self.top_p = mx.array([[ps[i].top_p] for i in self.top_p_rows]) if self.top_p_rows else None
        min_p = [p.min_p if sp else 0.0 for p, sp in zip(ps, sampled)]
        self.any_min_p = any(m > 0 for m in min_p)
        self.log_min_p = mx.log(mx.array([[m] for m in min_p])) if self.any_min_p else None
        self.any_penalty = any(s.uses_penalties for s in seqs)
        if self.any_penalty:
            self.rep = mx.array([[p.repetition_penalty] for p in ps])
            self.pres = mx.array([[p.presence_penalty] for p in ps])
            self.freq = mx.array([[p.frequency_penalty] for p in ps])
        rows, toks, vals = [], [], []
        for i, p in enumerate(ps):
            for t, v in p.logit_bias.items():
                rows.append(i)
                toks.append(int(t))
                vals.append(float(v))
        self.bias = (mx.array(rows, dtype=mx.int32), mx.array(toks, dtype=mx.int32), mx.array(vals)) if rows else None
        self.want_logprobs = any(s.wants_logprobs for s in seqs)
        self.top_n = max((p.top_logprobs for p in ps), default=0)
        eos = list(eos_ids)
        self.min_token_stops = [
            (i, p.min_tokens, sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))))
            for i, p in enumerate(ps) if p.min_tokens > 0]
        self.seeds = [s.seed for s in seqs]
        self.plain_greedy = (not self.any_sampled and not self.any_penalty and self.bias is None
                             and not self.want_logprobs and not self.min_token_stops)
        del B


class Sampler:
    def __init__(self, vocab_size: int, *, compiled: bool = True) -> None:
        self.vocab_size = vocab_size
        self.compiled = compiled

    def sample(self, logits: mx.array, bp: BatchParams, positions: list[int],
               counts: mx.array | None = None, seen: mx.array | None = None,
               bitmask: mx.array | None = None) -> SampleOut:
        """Sample one token per row. `positions[i]` is the output index row i is sampling;
        `bitmask`: the grammar constraints' allowed tokens (None: no row is constrained)."""
        if bp.plain_greedy and bitmask is None:
            return SampleOut(mx.argmax(logits.astype(mx.float32), axis=-1).astype(mx.int32))
        z = self.process(logits, bp, positions, counts, seen, bitmask)
        if bp.any_sampled:
            noise = gumbel_noise([noise_key(s, p) for s, p in zip(bp.seeds, positions)], self.vocab_size,
                                 compiled=self.compiled)
            tokens = mx.argmax(z + noise * bp.noise_on, axis=-1).astype(mx.int32)
        else:
            tokens = mx.argmax(z, axis=-1).astype(mx.int32)
        out = SampleOut(tokens)
        if bp.want_logprobs:
            lp = log_softmax(z)
            out.logprobs = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
            if bp.top_n:
                out.top_ids, out.top_logprobs = top_of(lp, bp.top_n)
        return out

    def process(self, logits: mx.array, bp: BatchParams, positions: list[int],
                counts: mx.array | None = None, seen: mx.array | None = None,
                bitmask: mx.array | None = None) -> mx.array:
        """The distribution each row samples from, as float32 logits z (softmax(z) is it): penalties,
        logit bias, min_tokens, the grammar mask, then for sampled rows temperature and the filters
        (filtered tokens at -inf); a greedy row's z is its processed logits (its sample is their argmax)."""
        l = logits.astype(mx.float32)
        if bp.any_penalty:
            pen = _penalize_compiled if self.compiled else _penalize
            l = pen(l, counts, seen, bp.rep, bp.pres, bp.freq)
        if bp.bias is not None:
            rows, toks, vals = bp.bias
            l = l.at[rows, toks].add(vals)
        masked = [(i, t) for i, n, stops in bp.min_token_stops if positions[i] < n for t in stops]
        if masked:
            rows = mx.array([i for i, _ in masked], dtype=mx.int32)
            toks = mx.array([t for _, t in masked], dtype=mx.int32)
            l = l.at[rows, toks].add(mx.full((len(masked),), NEG_INF))
        if bitmask is not None:
            l = apply_bitmask(l, bitmask, compiled=self.compiled)
        if bp.any_sampled:
            return self._filter(l * bp.inv_temp, bp)
        return l

    def _filter(self, z: mx.array, bp: BatchParams) -> mx.array:
        if bp.kmax:
            vals = mx.sort(mx.topk(z, bp.kmax, axis=-1), axis=-1)  # ascending, [B, kmax]
            idx = mx.maximum(bp.kmax - bp.top_k_arr, 0)[:, None]
            thr = mx.take_along_axis(vals, idx, axis=-1)
            thr = mx.where(bp.top_k_arr[:, None] > 0, thr, NEG_INF)
            z = mx.where(z >= thr, z, NEG_INF)
        if bp.top_p_rows:
            idx = mx.array(bp.top_p_rows, dtype=mx.int32)
            srt = -mx.sort(-z[idx], axis=-1)  # descending
            p = mx.softmax(srt, axis=-1)
            before = mx.cumsum(p, axis=-1) - p  # mass strictly above each token
            keep = mx.maximum(mx.sum(before < bp.top_p, axis=-1, keepdims=True), 1)
            thr_rows = mx.take_along_axis(srt, keep - 1, axis=-1)  # [r, 1]
            thr = mx.full((bp.size, 1), NEG_INF)
            thr[idx] = thr_rows
            z = mx.where(z >= thr, z, NEG_INF)
        if bp.any_min_p:
            zmax = mx.max(z, axis=-1, keepdims=True)
            z = mx.where(z >= zmax + bp.log_min_p, z, NEG_INF)
        return z


def _row_state(prompt_ids: list[int], output_ids: list[int], vocab_size: int) -> tuple[mx.array, mx.array]:
    """One row's penalty state: counts of output tokens, and which tokens were seen at all."""
    c = mx.zeros((vocab_size,))
    if output_ids:
        c = c.at[mx.array(output_ids, dtype=mx.int32)].add(1.0)
    s = mx.zeros((vocab_size,))
    s[mx.array(prompt_ids + output_ids, dtype=mx.int32)] = 1.0
    return c, s


def penalty_rows(seqs: Seq[Sequence], vocab_size: int) -> tuple[mx.array, mx.array]:
    """Penalty state [len(seqs), vocab] of sequences that are not in live rows yet."""
    states = [_row_state(s.prompt_ids, s.output_ids, vocab_size) for s in seqs]
    return mx.stack([c for c, _ in states]), mx.stack([s for _, s in states])


class PenaltyState:
    """Per-row token counts for penalties, aligned with the live KV rows.

    `counts` counts output tokens (presence/frequency penalties), `seen` marks prompt and
    output tokens (repetition penalty). Allocated only while some running sequence uses a
    penalty; rows of other sequences hold zeros or stale values that neutral parameters ignore.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows = 0
        self.counts: mx.array | None = None
        self.seen: mx.array | None = None

    @property
    def active(self) -> bool:
        return self.counts is not None

    def activate(self, rows: int) -> None:
        if not self.active:
            self.counts = mx.zeros((rows, self.vocab_size))
            self.seen = mx.zeros((rows, self.vocab_size))
            self.rows = rows

    def deactivate(self) -> None:
        self.counts = self.seen = None

    def resize(self, rows: int) -> None:
        self.rows = rows
        if not self.active or self.counts.shape[0] == rows:
            return
        keep = min(rows, self.counts.shape[0])
        counts, seen = mx.zeros((rows, self.vocab_size)), mx.zeros((rows, self.vocab_size))
        counts[:keep] = self.counts[:keep]
        seen[:keep] = self.seen[:keep]
        self.counts, self.seen = counts, seen
        mx.eval(self.counts, self.seen)

    def copy_rows(self, pairs: list[tuple[int, int]]) -> None:
        if not self.active:
            return
        srcs = [(mx.contiguous(self.counts[s]), mx.contiguous(self.seen[s])) for s, _ in pairs]
        mx.eval(srcs)
        for (_, d), (c, s) in zip(pairs, srcs):
            self.counts[d] = c
            self.seen[d] = s

    def init_row(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.counts[row], self.seen[row] = _row_state(prompt_ids, output_ids, self.vocab_size)

    def update(self, tokens: mx.array) -> None:
        """Count the tokens just sampled by rows [0, len(tokens))."""
        rows = mx.arange(tokens.shape[0], dtype=mx.int32)
        self.counts = self.counts.at[rows, tokens].add(1.0)
        self.seen[rows, tokens] = 1.0

    def arrays(self) -> list[mx.array]:
        return [self.counts, self.seen] if self.active else []
