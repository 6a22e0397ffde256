"""Decode passes under `mx.compile`, traced once per (rows bucket, key-span bucket) (`engine.compiled_decode`).

A small model's decode pass on a GPU is launch-bound: building the graph in Python and launching
~300-500 kernels takes longer than the GPU work (docs/performance.md). Compiled, the pass runs no
Python per step and MLX fuses its elementwise chains; on an H100 (smollm2-135m shape, 16 rows,
perf/profile_compiled_pass.py, retired: git show 3928439:perf/profile_compiled_pass.py)
13.3 -> 7.9 ms at a 256-slot KV.

A compiled function needs fixed shapes, so a pure-decode pass of n rows runs as one of B rows
(n rounded up to a bucket: 1, 2, 4, ... 32, then multiples of 32, at most the rows of per-row
state) attending over T key positions (the longest row's span rounded up to a power of two, at
least MIN_SPAN, at most the rows' capacity), with a mask hiding each row's unused tail. The KV
block stores themselves are its inputs and outputs, with each row's write slot [B] and read slots
[B, T] (from its block table, cache.LiveKV.pass_slots and read_slots): each row's new K/V is scattered at its
own slot and the rows' K/V gathered through their slots, as the eager pass does. A padded row
(n <= r < B) reads row n-1's slots and its logits are dropped; it writes nothing of its own: its
store repeats row n-1's (same slot and values, so the scatter's duplicate indices agree). It
does not read the old value to write it back: a read of the store in the pass other than the
gather after the write stops MLX from updating it in place, and every step would copy the whole
KV (measured with the dense rows: 0.03 ms -> 211 ms for one layer's scatter at 16 rows x 32,768
slots on the CPU). A trace is kept per store size too (the store grows by half at a time). The
model's weights are
inputs too (`mx.compile(..., inputs=model)`), so a full-weight update needs no retrace; a module
must therefore read its arrays from the model's tree when called, not through a reference kept
elsewhere (MLX refuses such an "uncaptured input"; fastmath.FastRoPE reads its RoPE's `_freqs`).

Adapters: the router's plan for the pass's rows (padded rows take row n-1's adapter) is an input
too (compiled_lora.py), so a trainer's next version of an adapter runs in the same trace. What
falls back to the eager pass, counted in stats (`compiled_decode`): adapters on expert (MoE)
projections, a model with recurrent state or several caches per layer, a pass the buckets do not
fit, and a model whose pass does not trace (then never tried again). At most MAX_TRACES traces are
kept (least recently used first out).

The math differs from the eager pass only in shapes: rows are padded, keys span T >= the longest
row (masked), and the mask is always applied (the eager pass skips it when every row is at the same
position). On the CPU every token and logprob the tests compare came out bit-identical; matrix
products and reductions over other shapes may round differently elsewhere, so the tests allow 1e-5
on logprobs (tests/test_engine_compiled.py).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from parallm.adapters.lora import LoRARouter

from . import key_tiles
from .pass_view import WriteIndex, gather, read_slots
from .kv_format import KV, KVFormat, mark
from .compiled_lora import AdaptedLayers, Captured, capture, rebuild
from .plan import power_of_two_bucket

log = logging.getLogger("parallm.engine")

MIN_SPAN = 128
MAX_TRACES = 32
ROW_STEP = 32  # past this many rows, buckets are its multiples


def row_bucket(n: int, rows: int) -> int:
    """The padded row count of an n-row pass over a live buffer of `rows` rows."""
    b = 1 << max(0, n - 1).bit_length() if n <= ROW_STEP else -(-n // ROW_STEP) * ROW_STEP
    return min(b, rows)


def span_bucket(span: int, capacity: int) -> int:
    """The key positions a pass attends over: `span` rounded up to a power of two (>= MIN_SPAN),
    at most the buffer's capacity."""
    return power_of_two_bucket(span, MIN_SPAN, capacity)


class StaticRowsView:
    """One layer's cache in a compiled pass over rows [0, B) of the live buffers: row r stores its
    token at offsets[r] (a padded row repeats row n-1's store) and attends over [0, T)."""

    def __init__(self, keys: KV, values: KV, pass_: "_PassInputs") -> None:
        self.keys, self.values, self._pass = keys, values, pass_
        self._fetched: tuple[KV, KV] | None = None
        mark(self, pass_.kv_format)

    def __bool__(self) -> bool:
        return True

    @property
    def offset(self) -> mx.array:
        return self._pass.offsets

    def is_trimmable(self) -> bool:
        return False

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KV, KV]:
        p = self._pass
        if keys.shape[0] != p.rows or keys.shape[2] != 1:
            raise ValueError(f"compiled decode view expected [{p.rows}, heads, 1, dim] keys, got {keys.shape}")
        fmt = p.kv_format
        self.keys = _store(self.keys, fmt.encode(keys), p)
        self.values = _store(self.values, fmt.encode(values), p)
        self._fetched = fmt.fetched(gather(self.keys, p.read)), fmt.fetched(gather(self.values, p.read))
        return self._fetched

    def keys_and_values(self) -> tuple[KV, KV]:
        if self._fetched is None:
            raise ValueError("keys_and_values() before this pass stored any keys")
        return self._fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if N != 1:
            raise ValueError(f"mask for {N} tokens requested in a decode pass")
        return self._pass.mask(window_size)

    @property
    def state(self) -> tuple[KV, KV]:
        return self.keys, self.values


def _stored(out: list) -> list[KV]:
    """A compiled pass's returned buffers as the live KV keeps them (a quantized layer's parts as a tuple)."""
    return [tuple(kv) if isinstance(kv, (list, tuple)) else kv for kv in out]


def _store(buf: KV, new: KV, p: "_PassInputs") -> KV:
    """The new token's K or V [B, heads, 1, width] (each stored part) into the store at each row's slot."""
    if isinstance(buf, tuple):
        return tuple(_store(b, n, p) for b, n in zip(buf, new))
    x = new[:, :, 0, :][p.src].transpose(1, 0, 2)  # [heads, B, width]
    if buf.ndim == 4:  # transposed K tiles (key_tiles.py)
        return key_tiles.write(buf, x, p.write_index.tiles(buf.shape))
    buf[p.write_index(new.shape[1])] = x
    return buf


class _PassInputs:
    """The traced per-pass inputs the layer views share (tracers inside the compiled function)."""

    def __init__(self, offsets: mx.array, src: mx.array, write: mx.array, read: mx.array, span: int, mask5d: bool,
                 kv_format: KVFormat) -> None:
        self.offsets, self.src, self.span, self.mask5d = offsets, src, span, mask5d
        self.read = read  # [B, T] slots
        self.kv_format = kv_format
        self.rows = int(src.shape[0])  # B
        self._masks: dict[int | None, mx.array] = {}
        self.write_index = WriteIndex(write)  # [B] slots: a padded row repeats row n-1's

    def mask(self, window: int | None) -> mx.array:
        m = self._masks.get(window)
        if m is None:
            k = mx.arange(self.span, dtype=mx.int32)[None, None, :]
            q = self.offsets[:, None, None]
            m = k <= q  # [B, 1, T]
            if window is not None:
                m = m & (k > q - window)
            m = m[:, None] if not self.mask5d else m[:, None, None]
            self._masks[window] = m
        return m


class CompiledDecode:
    """The compiled decode passes of one model over one engine's live KV (see module docstring)."""

    def __init__(self, model: nn.Module, call_model: Callable[[mx.array, list], mx.array], *, mask5d: bool,
                 router: LoRARouter | None = None) -> None:
        self.model = model
        self.call_model = call_model
        self.mask5d = mask5d
        self.router = router
        self.layers = AdaptedLayers(model)
        self.unsupported = ""  # why this model never runs compiled (set when its pass does not trace)
        self._fns: OrderedDict[tuple, Callable] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def stats(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def why_not(self, seqs: list, live: Any) -> str:
        """Why these rows' decode pass runs eagerly ('' when it may run compiled)."""
        if self.unsupported:
            return self.unsupported
        if live.layout is not None or live.states:
            return "state"
        if len(seqs) > live.rows:
            return "rows"
        if self.router is None and any(s.lora is not None for s in seqs):
            return "adapter"
        return ""

    def run(self, seqs: list, tokens: mx.array, live: Any, tables: list[list[int]] | None = None) -> mx.array | None:
        """The logits [n, vocab] of one decode pass over rows [0, n) of `live` (their block tables:
        `tables`, else the sequences'), its K/V written, or None when it must run eagerly (the reason
        counted)."""
        reason = self.why_not(seqs, live)
        if reason:
            self.counts[f"eager_{reason}"] += 1
            return None
        n = len(seqs)
        offsets = [s.num_computed for s in seqs]
        B, T = row_bucket(n, live.rows), span_bucket(max(offsets) + 1, live.capacity)
        pad = B - n
        adapted = any(s.lora is not None for s in seqs)
        captured: Captured | None = (("base",), [])
        if adapted:
            self.router.bind([s.lora for s in seqs] + [seqs[-1].lora] * pad)  # a padded row runs row n-1's adapter
            try:
                captured = capture(self.router, self.layers)
            finally:
                self.router.unbind()
            if captured is None:
                self.counts["eager_adapter"] += 1
                return None
        signature, lora_arrays = captured
        fn, fresh = self._trace(live, B, T, signature, live.format)
        saved = tree_flatten(self.model) if fresh else None  # a failed trace leaves its tracers in the model
        if pad:
            tokens = mx.concatenate([tokens.astype(mx.int32), mx.zeros((pad,), mx.int32)])
        offs = mx.array(offsets + offsets[-1:] * pad, dtype=mx.int32)
        src = mx.array(list(range(n)) + [n - 1] * pad, dtype=mx.int32)
        tables = [s.block_ids for s in seqs] if tables is None else tables
        table, write = live.pass_slots(tables + tables[-1:] * pad, offsets + offsets[-1:] * pad, 1, T)
        read, write = mx.array(read_slots(table, live.block_size, T)), mx.array(write)
        try:
            logits, keys, values = fn(tokens.astype(mx.int32), offs, src, write, read, live.keys, live.values,
                                      lora_arrays)
        except Exception as exc:  # noqa: BLE001 - a layer that does not trace: this model runs eagerly from now on
            if saved is not None:
                self.model.update(tree_unflatten(saved), strict=False)
            self._fns.clear()
            self.unsupported = "trace_failed"
            self.counts["eager_trace_failed"] += 1
            log.warning("compiled decode disabled: the model's decode pass did not trace (%s: %s)",
                        type(exc).__name__, exc)
            return None
        live.keys, live.values = _stored(keys), _stored(values)
        # the trace's scatter is an MLX op: with CUDA's in-place writes on, the pass in flight must finish first
        # (LiveKV.settle), or MLX copies the whole store for this write
        live.op_written()
        self.counts["compiled"] += 1
        for name, happened in (("padded", pad), ("adapter", adapted)):
            if happened:
                self.counts[name] += 1
        return logits[:n] if pad else logits

    def _trace(self, live: Any, B: int, T: int, signature: tuple, kv_format: KVFormat) -> tuple[Callable, bool]:
        """The compiled pass of this key, and whether it is new (traced on this call); at most
        MAX_TRACES kept. MLX does not put the model's own arrays back when a trace raises, so the
        caller saves them around a new one (a trace MLX redoes inside a kept function, for a model
        whose tree an adapter load reshaped, is of a pass that traced before)."""
        key = (live.rows, live.capacity, live.store_blocks, B, T, signature)
        fn = self._fns.get(key)
        if fn is not None:
            self._fns.move_to_end(key)
            return fn, False
        fn = self._fns[key] = mx.compile(self._pass_fn(T, signature, kv_format), inputs=self.model)
        self.counts["traces"] += 1
        while len(self._fns) > MAX_TRACES:
            self._fns.popitem(last=False)
            self.counts["evicted"] += 1
        return fn, True

    def _pass_fn(self, span: int, signature: tuple, kv_format: KVFormat) -> Callable:
        """A new function object per trace key (mx.compile caches by function, so dropping one frees its traces)."""
        call_model, mask5d, router = self.call_model, self.mask5d, self.router

        def decode_pass(tokens: mx.array, offsets: mx.array, src: mx.array, write: mx.array, read: mx.array,
                        keys: list, values: list, lora: list):
            p = _PassInputs(offsets, src, write, read, span, mask5d, kv_format)
            views = [StaticRowsView(k, v, p) for k, v in zip(keys, values)]
            if router is not None:
                router.plan = rebuild(signature, lora)
            try:
                logits = call_model(tokens[:, None], views)[:, -1, :]
            finally:
                if router is not None:
                    router.unbind()
            return logits, [v.keys for v in views], [v.values for v in views]

        return decode_pass
