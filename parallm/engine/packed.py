"""Packed passes: running rows' decode tokens and prompt chunks in one forward pass over a flat run
of tokens (engine.mixed_passes). `PackedContext` lays the pass out and attends each segment over
its own rows of the live KV; `PackedView` is a layer's cache in such a pass; `TokenPositions` and
`PackedMask` are the offset and mask the model hands to the fast-math RoPE and attention
(parallm/engine/fastmath.py), which read the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .cache import LiveKV
from .pass_view import LayerView, PassContext, WriteIndex, scatter
from .kv_format import KV, KVFormat
from .paged_attention import PrefillRead, chunks_read_in_place, paged_decode_attention


class TokenPositions:
    """The `offset` a packed pass hands to RoPE: the position of every token of the pass [N]
    (parallm.engine.fastmath's RoPE reads it; anything else that touches it fails loudly)."""

    __slots__ = ("positions",)

    def __init__(self, positions: mx.array) -> None:
        self.positions = positions


@dataclass(frozen=True, slots=True)
class PackedMask:
    """The `mask` of one layer in a packed pass: which sliding window (if any) the layer uses;
    each segment of the pass builds its own boolean mask from it."""

    window: int | None


class PackedContext:
    """One forward pass over a flat run of tokens from two kinds of rows: one new token of each
    running row [0, n_dec) (decode), then the next prompt chunk of each prefilling row
    [row0, row0 + k) (prefill), in that order and without padding.

    The model sees a batch of one sequence of N tokens, so every weight is read once for the
    decode tokens and the prompt chunks together (on the CPU the weights' memory traffic is most
    of a decode step: a separate prefill pass reads them all again). Only attention is per
    segment: `attend` splits the queries back into [rows, heads, L, dim] for the decode rows
    and the prefill rows and attends each over its own rows of the live KV: the decode segment
    through the block tables in place where the runner says decode passes do (`decode.paged_way`,
    paged_attention.py), the prompt chunks over their rows' gathered K/V."""

    def __init__(self, decode_offsets: list[int], row0: int, starts: list[int], lengths: list[int],
                 decode_tables: list[list[int]] | None = None, prefill_tables: list[list[int]] | None = None) -> None:
        self.n_dec = len(decode_offsets)
        self.decode = (PassContext(0, decode_offsets, 1, max(decode_offsets) + 1, tables=decode_tables)
                       if decode_offsets else None)
        L = max(lengths)
        self.prefill = PassContext(row0, starts, L, max(starts) + L, tables=prefill_tables)
        self.starts = starts
        self.lengths = lengths
        self.uniform = all(n == L for n in lengths)
        pos = list(decode_offsets) + [s + t for s, n in zip(starts, lengths) for t in range(n)]
        self.size = len(pos)
        self.positions = TokenPositions(mx.array(pos, dtype=mx.int32))
        self.write: mx.array | None = None  # [N] each token's slot (bind)
        self.write_index: WriteIndex | None = None
        self.in_place: PrefillRead | None = None  # the prompt chunks' read of the stores in place (bind, K tiled)
        self.kv_format: KVFormat | None = None  # the live KV's, set by views()
        self._bound: LiveKV | None = None
        if not self.uniform:
            # prompt token j of prefill row i sits at packed index first[i] + j; a padded
            # [k, L] view repeats each row's last token past its end (those outputs are dropped)
            first = [sum(lengths[:i]) for i in range(len(lengths))]
            self.pad_index = mx.array([first[i] + min(t, n - 1) for i, n in enumerate(lengths) for t in range(L)],
                                      dtype=mx.int32)
            self.unpad_index = mx.array([i * L + t for i, n in enumerate(lengths) for t in range(n)], dtype=mx.int32)

    def bind(self, live: LiveKV) -> None:
        """Resolve both segments' slots in `live`'s store, and every token's write slot."""
        if self._bound is live:
            return
        self.prefill.bind(live)
        span = self.prefill.span
        flat = mx.array([i * span + s + t for i, (s, n) in enumerate(zip(self.starts, self.lengths)) for t in range(n)],
                        dtype=mx.int32)
        prompt = self.prefill.read.reshape(-1)[flat]
        if self.decode is not None:
            self.decode.bind(live)
            self.write = mx.concatenate([self.decode.write, prompt])
        else:
            self.write = prompt
        self.write_index = WriteIndex(self.write)
        self.in_place = (PrefillRead(self.prefill._table, self.starts, self.lengths, self.prefill.length, live.block_size)
                         if live.keys_transposed and chunks_read_in_place(self.prefill.length, self.prefill.span)
                         else None)
        self._bound = live

    def views(self, live: LiveKV) -> list["PackedView"]:
        """One view per layer of `live` for this pass (LiveKV.views)."""
        if live.layout:
            raise ValueError("a model with recurrent state cannot run packed passes")
        if live.format.quantized and not live.format.marks_cache:
            raise ValueError("packed passes read quantized K/V through the quantized matmuls only")
        self.kv_format = live.format
        self.bind(live)
        return [PackedView(live, i, self) for i in range(len(live.shapes))]

    def attend(self, queries: mx.array, keys: KV, values: KV, scale: float, window: int | None,
               sdpa: Any) -> mx.array:
        """Attention of the packed queries [1, heads, N, dim] over the K/V stores (each segment's
        rows gathered through their block tables), with `sdpa(q, k, v, cache, scale, mask)` for
        [rows, heads, L, dim] queries (quantized K/V: its `cache` is the KV format, whose `bits` and
        `group_size` switch it to the quantized matmuls)."""
        cache = self.kv_format if isinstance(keys, tuple) else None
        q = queries[0]
        H, _, D = q.shape
        outs = []
        if self.decode is not None:
            ctx, n = self.decode, self.n_dec
            whole = window is None or ctx.span <= window  # every held key is in the window
            qd = q[:, :n].transpose(1, 0, 2)[:, :, None]
            if ctx.paged_way is not None and ctx.paged is not None and whole and cache is None:
                # read through the block tables in place, as a decode pass is (no copy of the rows' K/V)
                bs = self._bound.block_size
                k4 = keys if keys.ndim == 4 else keys.reshape(keys.shape[0], -1, bs, keys.shape[-1])  # ndim 4: K tiles transposed
                v4 = values.reshape(values.shape[0], -1, bs, values.shape[-1])
                od = paged_decode_attention(qd, k4, v4, ctx.paged, scale, None if ctx.paged_way == "auto" else ctx.paged_way,
                                            keys_transposed=keys.ndim == 4)
            else:
                mask = None if ctx.unmasked and whole else ctx.mask(window)
                od = sdpa(qd, ctx.gather(keys), ctx.gather(values), cache, scale, mask)
            outs.append(od[:, :, 0].transpose(1, 0, 2))
        ctx, k, L = self.prefill, len(self.lengths), self.prefill.length
        qp = q[:, self.n_dec:]
        if not self.uniform:
            qp = qp[:, self.pad_index]
        qp = qp.reshape(H, k, L, D).transpose(1, 0, 2, 3)
        if (self.in_place is not None and cache is None and keys.ndim == 4 and qp.dtype == mx.float32
                and (window is None or ctx.span <= window)):  # K as transposed tiles: the CPU's gather_mm way
            op = self.in_place.attend(qp, keys, values.reshape(values.shape[0], -1, keys.shape[-1], values.shape[-1]),
                                      scale)
        else:
            op = sdpa(qp, ctx.gather(keys), ctx.gather(values), cache, scale, ctx.mask(window))
        op = op.transpose(1, 0, 2, 3).reshape(H, k * L, -1)
        if not self.uniform:
            op = op[:, self.unpad_index]
        outs.append(op)
        return mx.concatenate(outs, axis=1)[None]


class PackedView(LayerView):
    """One layer's cache in a packed pass (see PackedContext): stores every token's K/V at its
    own slot with one scatter and leaves attention to `PackedContext.attend`."""

    def __init__(self, live: "LiveKV", layer: int, ctx: PackedContext) -> None:
        super().__init__(live, layer)
        self.packed = ctx

    @property
    def offset(self) -> TokenPositions:
        return self.packed.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KV, KV]:
        ctx, live, i = self.packed, self._live, self._layer
        if keys.shape[0] != 1 or keys.shape[2] != ctx.size:
            raise ValueError(f"packed cache view expected [1, heads, {ctx.size}, dim] keys, got {keys.shape}")
        fmt = live.format  # the pass's tokens are one row of N: the store's layout [heads, N, width]
        live.op_written()
        k_buf = scatter(live.keys[i], fmt.encode(keys), ctx.write_index)
        v_buf = scatter(live.values[i], fmt.encode(values), ctx.write_index)
        live.keys[i], live.values[i] = k_buf, v_buf
        return k_buf, v_buf

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> PackedMask:
        if N != self.packed.size:
            raise ValueError(f"mask for {N} tokens requested in a packed pass of {self.packed.size}")
        return PackedMask(window_size)

    @property
    def state(self) -> tuple[KV, KV]:
        return self._live.keys[self._layer], self._live.values[self._layer]
