"""The one place that owns MLX arrays: the KV block store, per-row state, penalty state; runs the passes."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn

from parallm.adapters.lora import LoRARouter

from .cache import LiveKV
from .pass_view import PassContext
from .compat import ModelInfo
from .compiled import CompiledDecode
from .fastmath import stand_ins
from .fused_projections import FusedProjections
from .head import OutputHead
from .images import prefill_embeddings
from .kv_format import KVFormat
from .packed import PackedContext, PackedView
from .paged_attention import chunks_read_in_place, transposes_keys
from .paged_decode import check_paged_decode, check_paged_prefill, replaces_attention, resolved_way
from .plan import PrefillWork, RowOp
from .prefix_tier import PrefixDiskTier
from .row_ops import execute_row_ops
from .sampling import (BatchParams, PenaltyState, SampledLists, SampleOut, Sampler, log_softmax, penalty_rows, rank_of,
                       top_of)
from .sequence import Sequence

log = logging.getLogger("parallm.engine")
_NO_CONTEXT = contextlib.nullcontext()


def _leads(seq: Sequence) -> bool:
    return seq.group is not None and seq.group.leader is seq


def pending_tokens(seqs: list[Sequence], prev: Launch) -> list[int | None]:
    """Each row's token still in flight in `prev` (read from the device: waits for that pass), or None."""
    tokens = prev.out.tokens.tolist()
    return [tokens[prev.row_of[s.seq_id]] if s.inflight else None for s in seqs]


def first_seqs(finishing: list[tuple[int, Sequence]]) -> list[Sequence]:
    """The sequences that sample a first token when these prompts finish: each, then its n > 1
    siblings waiting to be forked from it."""
    out = []
    for _, seq in finishing:
        out.append(seq)
        if _leads(seq):
            out.extend(seq.group.followers)
    return out


@dataclass(slots=True)
class FirstTokens:
    """Tokens sampled from the last prompt position by a prefill pass: row i is seqs[i]'s."""

    seqs: list[Sequence]
    sampled: SampledLists


@dataclass(slots=True)
class Launch:
    """A decode pass whose results have not been read yet."""

    seqs: list[Sequence]
    epochs: list[int]
    out: SampleOut
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> row in this pass
    versions: list[int] = field(default_factory=list)  # adapter version each row ran under
    fresh: list = field(default_factory=list)  # adapter versions sampling their first token in this pass


def _launch_of(seqs: list[Sequence], out: SampleOut) -> Launch:
    return Launch(seqs=list(seqs), epochs=[s.epoch for s in seqs], out=out,
                  row_of={s.seq_id: i for i, s in enumerate(seqs)}, versions=[s.adapter_version for s in seqs])


class ModelRunner:
    def __init__(self, model: nn.Module, info: ModelInfo, *, vocab_size: int, num_blocks: int | None, block_size: int,
                 eos_ids: Iterable[int] = (), lora: LoRARouter | None = None, compile: bool = True,
                 fast_math: bool = False, compiled_decode: bool = False, in_place_kv_mb: float = -1,
                 unfused_prefill_keys: int = 0, unfused_decode: bool = False, vision: Any = None,
                 kv_format: KVFormat | None = None, paged_decode: str = "auto", write_in_place: bool = False,
                 fused_projections: bool = False) -> None:
        """`eos_ids`: the tokens `min_tokens` masks until reached (with each request's stop ids);
        `lora`: the router that tells the adapted layers which adapter each row of a pass uses;
        `compiled_decode`: pure-decode passes under mx.compile where they fit (compiled.py);
        `in_place_kv_mb`: from this live KV size on, a pass writing into it waits for the work in
        flight first (LiveKV.settle); negative: never; `unfused_prefill_keys`: prefill passes over at
        most this many keys attend without the fused kernel (fastmath.unfused_sdpa); `unfused_decode`:
        decode passes under a mask (rows at different lengths) do too; `vision`: a vision-language
        model's encoder, whose features prefill puts at the image tokens (images.py); `kv_format`: how K/V
        are stored (kv.bits, kv_format.py; the model's dtype by default); `paged_decode`: how a decode
        pass reads the block store (engine.paged_decode; "auto": the backend's way, paged_decode.py);
        `write_in_place`: decode passes read by the CUDA kernel store their K/V in place (engine.kv_write_in_place,
        cache.LiveKV.writes_in_place); `fused_projections`: the eager passes compute sibling projections
        (q/k/v, gate/up) as one matmul each where the model's forward allows (fused_projections.py)."""
        self.model = model
        self.vision = vision
        # before anything reads the model's layers: the members' arrays become views of the concatenations
        self.fused = FusedProjections(model) if fused_projections else None
        if self.fused is not None and not self.fused.active:
            self.fused = None
        self.info = info
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.kv_format = kv_format or KVFormat(info.dtype)
        self.penalties = PenaltyState(vocab_size)
        self.sampler = Sampler(vocab_size, compiled=compile)
        self._params_key: tuple | None = None
        self._params: BatchParams | None = None
        self.eos_ids = [int(t) for t in eos_ids]
        self.lora = lora
        # what runs a packed pass (mixed): the fast-math functions, or only their packed-pass parts
        self.packing = stand_ins(model, fast_math=fast_math, unfused_keys=unfused_prefill_keys,
                                 unfused_decode=unfused_decode)
        self.fast_math = self.packing if fast_math else None
        self.unfused_prefill = self.fast_math is None and unfused_prefill_keys > 0
        self.unfused_decode = self.fast_math is None and unfused_decode
        # decode passes read through the block tables where the attention stand-ins run them (checked
        # on first use, paged_decode.py); "off": over the gathered K/V, as every other pass
        self.paged_way = paged_decode if paged_decode != "off" and replaces_attention(self.fast_math or self.packing) \
            else None
        self._paged: bool | None = None if self.paged_way is not None else False
        self._prefill_in_place: bool | None = None
        self._write_in_place = write_in_place
        # K as transposed tiles where decode passes read the store with gather_mm (the CPU's way, key_tiles.py)
        self.live = LiveKV(info.shapes, info.dtype, info.layout, self.kv_format, block_size=block_size,
                           max_blocks=num_blocks, keys_transposed=transposes_keys(self.paged_way, info.dtype,
                                                                                self.kv_format.quantized))
        self.live.settle_bytes = in_place_kv_mb * 2**20 if in_place_kv_mb >= 0 else None
        self.head = OutputHead(model)
        # recurrent state (a packed pass is one sequence: a scan would run across rows) or several
        # caches per layer, or quantized K/V read dequantized (a packed pass reads the whole buffers):
        # no packed views; otherwise checked on first use (can_pack)
        dequantized = self.kv_format.quantized and not self.kv_format.marks_cache
        self._packing: bool | None = False if info.layout is not None or dequantized else None
        self.constraints = None  # constraints.Constraints: the grammar masks of constrained rows
        # a trace reads the weights from the model's tree (compiled.py), never from a group's concatenation
        self.compiled = (CompiledDecode(model, self._call_unfused, mask5d=info.mask5d, router=lora)
                         if compiled_decode else None)
        self.kv_tier: PrefixDiskTier | None = None  # the prefix cache's disk tier (prefix_tier.py)

    def _mask_job(self, seqs: list[Sequence]):
        """The grammar masks of `seqs`, started on the worker thread; None when no row is constrained."""
        c = self.constraints
        return c.submit(seqs) if c is not None and c.constrained(seqs) else None

    def _forward_masked(self, seqs: list[Sequence], prev: Launch | None,
                        run: Callable[[], mx.array]) -> tuple[mx.array, mx.array | None]:
        """`run()`, the forward pass building the logits of `seqs`, and their grammar masks (None when
        no row is constrained). A row whose last token is still in `prev`, the pass launched before,
        gets its mask once this forward is launched: the device finishes `prev` first, its tokens are
        read, and the worker fills the masks while the forward runs (vLLM's async scheduling with
        structured output), so the schedule stays overlapped and the row costs only its mask. Masks
        that need no such token are filled while the forward's graph is built."""
        c = self.constraints
        if c is None or not c.constrained(seqs):
            return run(), None
        waits = prev is not None and any(s.inflight for s in seqs)
        job = None if waits else c.submit(seqs)
        logits = run()
        self.live.settle()
        mx.async_eval(logits)
        if waits:
            job = c.submit(seqs, pending_tokens(seqs, prev))
        return logits, mx.array(job.result())

    @property
    def pages_decode(self) -> bool:
        """Whether decode passes read the block store through paged attention (paged_decode.py)."""
        if self._paged is None:
            can_write = self._write_in_place and self.paged_way == "auto" and not self.kv_format.quantized \
                and not self.live.keys_transposed and self.info.layout is None \
                and resolved_way(self.info, self.block_size) == "cuda"
            # (in place, fused): the write in the attention kernel, else a write kernel before it, else not in place
            tries = [(True, True), (True, False), (False, False)] if can_write else [(False, False)]
            chosen = next((t for t in tries if check_paged_decode(
                self.call_model, self.info, self.kv_format, self.block_size, self.vocab_size, self.paged_way,
                self.live.keys_transposed, *t)), None)
            self._paged = chosen is not None
            self.live.writes_in_place, self.live.fuses_newest = chosen or (False, False)
        return self._paged

    @property
    def prefills_in_place(self) -> bool:
        """Whether prefill passes attend over the K tiles in place (PassContext.prefill_in_place): where
        decode passes read the store with the CPU's gather_mm (K as transposed tiles) and a probe pass
        gives the gathered K/V's logits (paged_decode.check_paged_prefill)."""
        if self._prefill_in_place is None:
            self._prefill_in_place = (self.live.keys_transposed and self.info.layout is None and self.pages_decode
                                      and check_paged_prefill(self.call_model, self.info, self.kv_format,
                                                              self.block_size, self.vocab_size))
        return self._prefill_in_place

    def _forward(self, seqs: list[Sequence], tokens: mx.array, cache, per_token: list | None = None,
                 embeddings: mx.array | None = None, paged: bool = False) -> mx.array:
        """The model over `tokens` (or their `embeddings`, image features in place), row i under seqs[i]'s
        adapter (`per_token`: a packed pass's one row, token i under per_token[i]; `paged`: a decode pass
        read through the block tables, or a prefill pass whose chunks read K tiles in place); the graph is fixed on return."""
        lora = self.lora
        if lora is not None:
            lora.bind([s.lora for s in seqs] if per_token is None else per_token, packed=per_token is not None)
        try:
            return self.call_model(tokens, cache, packed=isinstance(cache[0], PackedView) if cache else False,
                                   embeddings=embeddings, paged=paged)
        finally:
            if lora is not None:
                lora.unbind()

    def _call_unfused(self, tokens: mx.array, cache) -> mx.array:
        return self.call_model(tokens, cache, fused=False)

    def call_model(self, tokens: mx.array, cache, *, packed: bool = False, embeddings: mx.array | None = None,
                   paged: bool = False, fused: bool = True) -> mx.array:
        """The model's graph over `tokens`, built with the fast-math kernels where enabled (a
        `packed` pass: with the functions that read its layout; a `paged` decode pass: with the
        attention stand-in that reads the block tables); `embeddings`: the pass's input embeddings
        instead of the tokens' own; `fused`: sibling projections fused where the runner fuses them."""
        length = tokens.shape[-1]
        unfused = (self.unfused_prefill and length > 1) or (self.unfused_decode and length == 1)
        context = self.packing if packed or unfused else (self.fast_math or self.packing) if paged else self.fast_math
        kw = {} if embeddings is None else {"input_embeddings": embeddings}
        with (self.fused if fused and self.fused is not None else _NO_CONTEXT), (context or _NO_CONTEXT):
            return self.model(tokens, cache=cache, **kw)

    # ------------------------------------------------------------------ row operations
    def execute(self, ops: list[RowOp], blocks: int = 0) -> None:
        """Run a step's row operations on the per-row state, the penalty state and the block store
        (row_ops.execute), the store grown first to hold block ids [0, blocks); the disk tier saves the
        blocks evicted since the last step before anything overwrites them, and (write-through) the
        blocks keyed then, whose KV the passes already wrote."""
        tier = self.kv_tier
        if tier is not None:
            tier.before_ops()
        if blocks:
            self.live.ensure(blocks)
        execute_row_ops(ops, self.live, self.penalties)
        if tier is not None:
            tier.after_ops()

    def rollback(self, seq: Sequence, length: int) -> None:
        """Keep only positions [0, length) of `seq`'s KV (the rest were written by a pass whose tokens
        were rejected: speculation's verify pass): num_computed is its length, positions past it are
        never attended and the next pass overwrites them; the table keeps its blocks (the scheduler
        allocated them for the next passes, and releases them with the sequence)."""
        seq.num_computed = length

    # ------------------------------------------------------------------ prefill
    def prefill(self, work: PrefillWork) -> tuple[dict[int, tuple], FirstTokens | None]:
        """Run one padded prefill pass. Returns prompt logprobs for rows that asked for them
        (seq_id -> (first position, logprobs list, top ids, top logprobs, ranks): the logprob of each
        next token given the ones before it, and its rank but for scores) and the first token of every
        prompt the pass finishes (for n > 1, one per sample of the request, from the same logits; none
        for prefill-only work)."""
        L = work.length
        rows = []
        finishing: list[tuple[int, Sequence]] = []  # (row in the pass, seq) whose prompt ends here
        logprob_rows: list[tuple[int, int, int]] = []  # (row, first position, end) whose logprobs are kept
        for i, (seq, start, n) in enumerate(zip(work.seqs, work.starts, work.lengths)):
            rows.append(seq.token_ids[start:start + n] + [0] * (L - n))
            if n and start + n == seq.prefill_target and not seq.prefill_only:
                finishing.append((i, seq))
            if seq.prompt_logprobs is not None:
                lo, hi = max(start, seq.logprobs_from), min(start + n, seq.num_tokens - 1)  # the last predicts none
                if lo < hi:
                    logprob_rows.append((i, lo, hi))
        wants_prompt = bool(logprob_rows)
        ctx = PassContext(work.row0, work.starts, L, max(work.starts) + L, mask5d=self.info.mask5d,
                          lengths=work.lengths, tables=[s.block_ids for s in work.seqs])
        ctx.prefill_in_place = chunks_read_in_place(L, ctx.span) and self.prefills_in_place
        tokens = mx.array(rows, dtype=mx.int32)
        embeds = None if self.vision is None else prefill_embeddings(self.model, self.vision, work.seqs, work.starts,
                                                                    work.lengths, tokens)
        last = mx.array([i * L + work.lengths[i] - 1 for i, _ in finishing], dtype=mx.int32)
        if finishing and not wants_prompt and self.head.usable:
            with self.head.select(last):  # only the finishing rows' last positions are projected
                logits = self._forward(work.seqs, tokens, self.live.views(ctx), embeddings=embeds,
                                       paged=ctx.prefill_in_place)
            last_logits = logits[0]
        else:
            logits = self._forward(work.seqs, tokens, self.live.views(ctx), embeddings=embeds, paged=ctx.prefill_in_place)
            last_logits = logits.reshape(-1, logits.shape[-1])[last] if finishing else None
        wanted = []
        for i, lo, hi in logprob_rows:
            seq, start = work.seqs[i], work.starts[i]
            targets = mx.array(seq.token_ids[lo + 1:hi + 1], dtype=mx.int32)
            lp = log_softmax(logits[i, lo - start:hi - start].astype(mx.float32))
            chosen = mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
            k = seq.prompt_top_k
            top = top_of(lp, k) if k else (None, None)
            ranks = None if seq.prefill_only else rank_of(lp, chosen)  # vLLM's prompt-logprob rank
            wanted.append((seq, lo, chosen, *top, ranks))
        first = self._sample_first(finishing, last_logits) if finishing else None
        self.live.settle()
        mx.eval(self.live.arrays(), [w[2:] for w in wanted], first.arrays() if first else [])
        del logits
        out = {}
        for seq, start, chosen, ids, vals, ranks in wanted:
            out[seq.seq_id] = (start, chosen.tolist(), None if ids is None else ids.tolist(),
                               None if vals is None else vals.tolist(), None if ranks is None else ranks.tolist())
        if first is None:
            return out, None
        return out, FirstTokens(first_seqs(finishing), first.read())

    def _sample_first(self, finishing: list[tuple[int, Sequence]], last_logits: mx.array) -> SampleOut:
        """Sample the next token of every finishing prompt (and of its n > 1 siblings, which
        share its logits) with each sequence's own parameters, seed and penalties."""
        seqs = first_seqs(finishing)
        source = [j for j, (_, seq) in enumerate(finishing)
                  for _ in range(1 + (len(seq.group.followers) if _leads(seq) else 0))]
        logits = last_logits if len(source) == len(finishing) else last_logits[mx.array(source, dtype=mx.int32)]
        bp = BatchParams(seqs, self.eos_ids, self.vocab_size)
        positions = [s.num_output for s in seqs]
        job = self._mask_job(seqs)
        if job is not None:  # the forward runs while the worker fills the masks, not after (issue 30: a first
            self.live.settle()  # mask of a 64 KiB grammar took ~10 ms of every constrained prompt's pass)
            mx.async_eval(logits)
        bitmask = None if job is None else mx.array(job.result())
        if bp.any_penalty:
            counts, seen = penalty_rows(seqs, self.vocab_size)
            return self.sampler.sample(logits, bp, positions, counts, seen, bitmask)
        return self.sampler.sample(logits, bp, positions, bitmask=bitmask)

    # ------------------------------------------------------------------ decode
    def batch_params(self, seqs: list[Sequence]) -> BatchParams:
        key = tuple(s.seq_id for s in seqs)
        if key != self._params_key:
            self._params = BatchParams(seqs, self.eos_ids, self.vocab_size)
            self._params_key = key
        return self._params

    def decode_inputs(self, seqs: list[Sequence], prev: Launch | None) -> mx.array:
        """Each running row's last token: read back, or still in `prev`, the pass launched before."""
        if prev is not None and all(s.inflight for s in seqs) and \
                all(prev.row_of.get(s.seq_id) == i for i, s in enumerate(seqs)) and len(prev.seqs) == len(seqs):
            return prev.out.tokens
        known = mx.array([0 if s.inflight else s.last_token for s in seqs], dtype=mx.int32)
        if prev is None or not any(s.inflight for s in seqs):
            return known
        src = [prev.row_of[s.seq_id] if s.inflight else 0 for s in seqs]
        from_prev = mx.array([bool(s.inflight) for s in seqs])
        return mx.where(from_prev, prev.out.tokens[mx.array(src, dtype=mx.int32)], known)

    def decode(self, seqs: list[Sequence], inputs: mx.array, positions: list[int], prev: Launch | None = None) -> Launch:
        """Build and launch one decode pass over rows [0, len(seqs)); `prev`: the pass launched before,
        not read yet, whose tokens a grammar-constrained row's mask needs. Nothing else is waited for."""
        def run() -> mx.array:
            if self.compiled is not None and (logits := self.compiled.run(seqs, inputs, self.live)) is not None:
                return logits
            offsets = [s.num_computed for s in seqs]
            ctx = PassContext(0, offsets, 1, max(offsets) + 1, mask5d=self.info.mask5d,
                              tables=[s.block_ids for s in seqs])
            if self.pages_decode:
                ctx.paged_way = self.paged_way
            return self._forward(seqs, inputs[:, None], self.live.views(ctx), paged=ctx.paged_way is not None)[:, -1, :]

        logits, bitmask = self._forward_masked(seqs, prev, run)
        out = self._sample_rows(seqs, logits, positions, bitmask)
        if bitmask is None:  # else _forward_masked launched the forward pass, and settled before it
            self.live.settle()  # the graph is built while the pass in flight runs; its launch waits for it
        mx.async_eval(out.arrays(), self.penalties.arrays())
        return _launch_of(seqs, out)

    def _sample_rows(self, seqs: list[Sequence], logits: mx.array, positions: list[int],
                     bitmask: mx.array | None = None) -> SampleOut:
        """The next token of running rows [0, len(seqs)) from their logits (grammar `bitmask` applied
        where given); counts it for penalties."""
        bp = self.batch_params(seqs)
        pen = self.penalties
        if bp.any_penalty:
            B = len(seqs)
            out = self.sampler.sample(logits, bp, positions, pen.counts[:B], pen.seen[:B], bitmask)
        else:
            if pen.active:
                pen.deactivate()
            out = self.sampler.sample(logits, bp, positions, bitmask=bitmask)
        if pen.active:
            pen.update(out.tokens)
        return out

    # ------------------------------------------------------------------ decode and prefill in one pass
    @property
    def can_pack(self) -> bool:
        """Whether running rows and prompt chunks can share one pass: needs the fast-math
        attention and RoPE (the only ones that read a packed pass's layout) and the output head,
        and is checked once against separate passes on this model."""
        if self._packing is None:
            self._packing = self._check_packing()
        return self._packing

    def mixed(self, seqs: list[Sequence], inputs: mx.array, positions: list[int],
              work: PrefillWork, prev: Launch | None = None) -> tuple[Launch, FirstTokens | None]:
        """One packed pass (packed.PackedContext): a decode token of every running row [0,
        len(seqs)), as `decode` samples it, and the next prompt chunk of every prefilling row, with
        the first token of each prompt it finishes, as `prefill` samples it (no prompt logprobs:
        the head projects only the sampled positions). Each token runs under its row's adapter
        (lora.packable says which mixes can). Waits for the pass."""
        n = len(seqs)
        ctx = PackedContext([s.num_computed for s in seqs], work.row0, work.starts, work.lengths,
                            [s.block_ids for s in seqs], [s.block_ids for s in work.seqs])
        if ctx.decode is not None and self.pages_decode:
            ctx.decode.paged_way = self.paged_way  # the decode segment reads the store in place
        prompt = [t for seq, start, k in zip(work.seqs, work.starts, work.lengths) for t in seq.token_ids[start:start + k]]
        tokens = mx.concatenate([inputs.astype(mx.int32), mx.array(prompt, dtype=mx.int32)])[None]
        finishing: list[tuple[int, Sequence]] = []
        picked = list(range(n))
        end = n
        for i, (seq, start, k) in enumerate(zip(work.seqs, work.starts, work.lengths)):
            end += k
            if k and start + k == seq.prefill_target:
                finishing.append((i, seq))
                picked.append(end - 1)
        lora = seqs[0].lora
        per_token = None if all(s.lora is lora for s in (*seqs, *work.seqs)) else \
            [s.lora for s in seqs] + [seq.lora for seq, k in zip(work.seqs, work.lengths) for _ in range(k)]

        def run() -> mx.array:
            with self.head.select(mx.array(picked, dtype=mx.int32)):
                return self._forward(seqs[:1] if per_token is None else seqs, tokens, self.live.views(ctx), per_token)[0]

        logits, bitmask = self._forward_masked(seqs, prev, run)
        out = self._sample_rows(seqs, logits[:n], positions, bitmask)
        first = self._sample_first(finishing, logits[n:]) if finishing else None
        self.live.settle()
        mx.eval(out.arrays(), self.penalties.arrays(), self.live.arrays(), first.arrays() if first else [])
        return _launch_of(seqs, out), FirstTokens(first_seqs(finishing), first.read()) if first else None

    def _check_packing(self) -> bool:
        """Logits of a packed pass (two decode rows, two prompts of different lengths) against
        the same rows run as a decode pass and a padded prefill pass, on scratch buffers."""
        if not self.packing.active or not self.head.usable:
            return False
        vocab = self.vocab_size

        def ids(n: int, seed: int) -> list[int]:
            return [(seed * 7919 + j * 104729) % vocab for j in range(n)]

        scratch = LiveKV(self.info.shapes, self.info.dtype, kv_format=self.kv_format, block_size=self.block_size,
                         keys_transposed=self.live.keys_transposed)
        scratch.resize(4, 32)
        m5 = self.info.mask5d
        try:
            pad7 = ids(5, 1) + [0, 0]
            mx.eval(self.call_model(mx.array([pad7, ids(7, 2)]), scratch.views(PassContext(0, [0, 0], 7, 7, mask5d=m5))),
                    scratch.arrays())
            step = mx.array([[ids(1, 3)[0]], [ids(1, 4)[0]]])
            want_dec = self.call_model(step, scratch.views(PassContext(0, [5, 7], 1, 8, mask5d=m5)))[:, -1]
            mx.eval(want_dec, scratch.arrays())
            p2, p3 = ids(6, 5), ids(3, 6)
            full = self.call_model(mx.array([p2, p3 + [0, 0, 0]]), scratch.views(PassContext(2, [0, 0], 6, 6, mask5d=m5)))
            want = mx.concatenate([want_dec, full[0, 5:6], full[1, 2:3]])
            mx.eval(want, scratch.arrays())
            tokens = mx.array(step[:, 0].tolist() + p2 + p3)[None]
            with self.head.select(mx.array([0, 1, 7, 10], dtype=mx.int32)):
                got = self.call_model(tokens, scratch.views(PackedContext([5, 7], 2, [0, 0], [6, 3])), packed=True)[0]
            atol = 1e-2
            if self.info.dtype != mx.float32:
                # half precision: a matmul over another number of rows rounds differently by itself
                # (a GPU's bf16 kernels), so allow 4x what one prompt alone differs from its batch
                alone = self.call_model(mx.array([p2]), scratch.views(PassContext(2, [0], 6, 6, mask5d=m5)))[0, 5]
                noise = mx.abs(alone.astype(mx.float32) - full[0, 5].astype(mx.float32)).max().item()
                atol = max(atol, 4 * noise)
            if got.shape != want.shape:
                return False
            ok = bool(mx.allclose(got, want, rtol=1e-3, atol=atol).item())
            diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
            log.info("packed passes %s: logits within %.4g of separate passes (allowed %.4g + 1e-3 relative)",
                     "on" if ok else "off", diff, atol)
            return ok
        except Exception as e:  # noqa: BLE001 - an architecture whose layers do not fit packed passes
            log.info("packed passes off: %s: %s", type(e).__name__, e)
            return False

