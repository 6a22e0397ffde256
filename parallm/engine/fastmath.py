"""The model's SwiGLU, attention and RoPE without MLX's slow CPU paths, swapped into the model's module.

The float32 kernels themselves (exp as 2^n * 2^f, SwiGLU, attention; why, and what they saved)
are parallm/kernels.py. The fast functions replace mlx-lm's `swiglu` and
`scaled_dot_product_attention` in the model's own module only while `FastMath` is entered (the
engine enters it around its passes) and only for the thread that entered it (`_ModuleSwap`), so any
other use of mlx-lm in the process (mlx_lm.generate, a trainer's loss, another engine of the same
family) keeps its own kernels.
They take float32 only; every other case (half precision, attention sinks) goes to the stock
function; quantized K/V (kv.bits) get the same attention through MLX's quantized matmuls. Likewise the model's rotate-half RoPE modules are stood in for by
`FastRoPE` (see `RopeTables`), and the attention runs packed passes (packed.PackedContext), which
only these functions understand.
"""

from __future__ import annotations

import math
import sys
import threading
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from parallm import kernels
from parallm.kernels import stock_sdpa, swiglu, unfused_sdpa

from .pass_view import PagedMask
from .packed import PackedMask, TokenPositions


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                                 scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
    """kernels.scaled_dot_product_attention, which also runs a packed pass (each segment with it) and
    a decode pass read through the block tables (pass_view.PagedMask)."""
    if isinstance(mask, PagedMask):
        out = cache.paged_attention(queries, keys, scale) if sinks is None else None
        if out is not None:
            return out
        keys, values = cache.fetched(keys, values)
        mask = mask.fallback
    if isinstance(mask, PackedMask):  # a packed pass (parallm.engine.packed.PackedContext)
        if sinks is not None or queries.dtype != mx.float32:
            raise ValueError("packed passes take float32 attention without sinks")
        return cache.packed.attend(queries, keys, values, scale, mask.window, scaled_dot_product_attention)
    return kernels.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)


@partial(mx.compile, shapeless=True)
def _rotate(x: mx.array, swapped: mx.array, cos: mx.array, signed_sin: mx.array) -> mx.array:
    return x * cos + swapped * signed_sin


class RopeTables:
    """cos/sin of one pass's positions, computed once and shared by every layer's RoPE.

    MLX's CPU backend has no RoPE kernel: `mx.fast.rope` runs its composed fallback (positions,
    frequencies, libm cos/sin of every (row, position, frequency), slices, four multiplies, two
    adds, a concatenate) in each layer for queries and keys alike: 114 us for a batch-16 decode
    query on this machine. The tables depend only on the positions (the cache's `offset`, one
    array per pass) and the RoPE's parameters, so they are built once per pass with the same
    operations as that fallback, and each layer's rotation is a concatenate and one fused
    multiply-add (23 us)."""

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[Any, mx.array, mx.array]] = {}

    def clear(self) -> None:
        self._tables.clear()

    def get(self, offset: Any, length: int, dims: int, base: float | None, scale: float,
            freqs: mx.array | None) -> tuple[mx.array, mx.array]:
        key = (id(offset), length, dims, base, scale, None if freqs is None else id(freqs))
        hit = self._tables.get(key)
        if hit is not None and hit[0] is offset:
            return hit[1], hit[2]
        half = dims // 2
        if isinstance(offset, TokenPositions):  # a packed pass: one position per token, [1, 1, N]
            positions = offset.positions.astype(mx.float32)[None, None] * mx.array(scale, dtype=mx.float32)
        else:
            off = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
            if off.size > 1:
                off = off.reshape(-1, 1, 1)  # [B, 1, 1]: positions [B, 1, L]
            positions = (mx.arange(length, dtype=mx.float32) + off) * mx.array(scale, dtype=mx.float32)
        if freqs is None:
            inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base) / half, dtype=mx.float32))
        else:
            inv = mx.reciprocal(freqs.astype(mx.float32))
        theta = positions[..., None] * inv
        cos, sin = mx.cos(theta), mx.sin(theta)
        table = (offset, mx.concatenate([cos, cos], -1), mx.concatenate([-sin, sin], -1))
        self._tables[key] = table
        return table[1], table[2]


def packed_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                sinks: mx.array | None = None, *, unfused_keys: int = 0, unfused_decode: bool = False) -> mx.array:
    """mlx-lm's stock attention, and `unfused_sdpa` for more than one query per row over at most
    `unfused_keys` keys, and (with `unfused_decode`) for one query per row under an array mask: what
    FastMath(exp=False) puts in the model's module (a GPU's short prefills, masked decode), a decode pass
    read through the block tables (pass_view.PagedMask: a GPU's paged attention kernel), and a packed
    pass, whose segments each attend by the same rule as the separate pass they stand for: with the
    stock kernel for every segment, a packed pass's bf16 logits on CUDA's defaults differed from the
    separate passes' by 0.16-0.18 (unfused against fused attention), and the runner's check refused
    packing (docs/performance.md, "Mixed passes, tried again")."""
    if isinstance(mask, PagedMask):
        out = cache.paged_attention(queries, keys, scale) if sinks is None else None
        if out is not None:
            return out
        keys, values = cache.fetched(keys, values)
        mask = mask.fallback
    if isinstance(mask, PackedMask):
        if sinks is not None:
            raise ValueError("packed passes take attention without sinks")
        return cache.packed.attend(queries, keys, values, scale, mask.window,
                                   partial(_segment_sdpa, unfused_keys=unfused_keys, unfused_decode=unfused_decode))
    return _segment_sdpa(queries, keys, values, cache, scale, mask, sinks,
                         unfused_keys=unfused_keys, unfused_decode=unfused_decode)


def _segment_sdpa(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                  sinks: mx.array | None = None, *, unfused_keys: int = 0, unfused_decode: bool = False) -> mx.array:
    """`packed_sdpa`'s choice for one pass's (or one packed segment's) [rows, heads, L, dim] queries."""
    if sinks is None and not hasattr(cache, "bits") and (
            (unfused_keys and queries.shape[2] > 1 and keys.shape[2] <= unfused_keys)
            or (unfused_decode and queries.shape[2] == 1 and isinstance(mask, mx.array))):
        return unfused_sdpa(queries, keys, values, scale, mask)
    return stock_sdpa(queries, keys, values, cache, scale, mask, sinks)


class FastRoPE:
    """Stands in for one nn.RoPE / mlx-lm Llama3RoPE module while fast math is entered: float32
    rotate-half inputs from the tables (with `tables`), a packed pass's per-token positions
    (TokenPositions) as a batch of one-token rows with the module's own kernel (array offsets:
    the same rotation as each token alone), anything else to the module itself."""

    def __init__(self, rope: nn.Module, tables: RopeTables | None) -> None:
        self.rope = rope
        self.tables = tables
        self.dims = rope.dims
        self.base = getattr(rope, "base", None)
        self.scale = float(getattr(rope, "scale", 1.0))

    @property
    def freqs(self) -> mx.array | None:
        """Read from the module on each call: under mx.compile(inputs=model) the module's own entry is
        the traced input, and a reference kept here would be an uncaptured input (compiled.py)."""
        return getattr(self.rope, "_freqs", None)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.tables is None or x.dtype != mx.float32 or x.ndim != 4:
            if isinstance(offset, TokenPositions):
                return self._per_token(x, offset.positions)
            return self.rope(x, offset=offset)
        dims, half = self.dims, self.dims // 2
        cos, signed_sin = self.tables.get(offset, x.shape[2], dims, self.base, self.scale, self.freqs)
        head = x if dims == x.shape[-1] else x[..., :dims]
        out = _rotate(head, mx.concatenate([head[..., half:], head[..., :half]], -1), cos, signed_sin)
        return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], -1)


    def _per_token(self, x: mx.array, positions: mx.array) -> mx.array:
        if x.ndim != 4 or x.shape[0] != 1:
            raise ValueError(f"a packed pass's RoPE takes [1, heads, tokens, dim] inputs, got {x.shape}")
        rows = x[0].transpose(1, 0, 2)[:, :, None]  # [tokens, heads, 1, dim]
        return self.rope(rows, offset=positions)[:, :, 0].transpose(1, 0, 2)[None]


def _fast_ropes(model: nn.Module, tables: RopeTables | None) -> list[tuple[nn.Module, str, nn.Module, FastRoPE]]:
    """(parent, attribute, module, stand-in) for each RoPE of the model that FastRoPE can take
    (with tables: rotate-half ones only)."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    out = []
    for _, parent in model.named_modules():
        for attr, child in parent.children().items():
            if not isinstance(child, nn.Module) or (tables is not None and getattr(child, "traditional", True)):
                continue
            plain = type(child) is nn.RoPE
            llama3 = type(child) is Llama3RoPE and getattr(child, "_freqs", None) is not None
            if plain or llama3:
                out.append((parent, attr, child, FastRoPE(child, tables)))
    return out


class _ModuleSwap:
    """The functions FastMath puts into model modules, one stand-in per (module, name) for the process.

    Several engines in one process can share a model module (a leader and a follower rank, an engine
    beside a draft model of the same family). Setting the module's global on enter and putting the
    original back on exit let one engine's exit pull the stand-in out from under another engine's
    graph mid-pass (a paged decode pass then reached mlx-lm's stock attention with its PagedMask).
    So the module holds one dispatcher from the first enter to the last exit (counted), and the
    dispatcher calls what the *calling thread's* innermost FastMath asked for, the original for a
    thread with none entered (a trainer's loss in another thread keeps the stock kernels)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed: dict[tuple[str, str], tuple[Any, Any, int]] = {}  # (module, name): original, dispatcher, users
        self._local = threading.local()

    def original(self, module: Any, name: str) -> Any:
        """The module's own function `name`, also while a dispatcher stands in for it."""
        with self._lock:
            entry = self._installed.get((module.__name__, name))
        return entry[0] if entry is not None and getattr(module, name, None) is entry[1] else getattr(module, name, None)

    def _chosen(self) -> dict[tuple[str, str], Any]:
        chosen = getattr(self._local, "chosen", None)
        if chosen is None:
            chosen = self._local.chosen = {}
        return chosen

    def enter(self, module: Any, functions: dict[str, Any]) -> dict[tuple[str, str], Any]:
        """Route `functions` (name: stand-in) of `module` to the stand-ins in this thread; returns what
        this thread's routes were before, for `leave`."""
        chosen = self._chosen()
        before = {}
        with self._lock:
            for name, fast in functions.items():
                key = (module.__name__, name)
                original, dispatcher, users = self._installed.get(key) or (getattr(module, name), None, 0)
                if dispatcher is None:
                    dispatcher = self._dispatcher(key, original)
                    setattr(module, name, dispatcher)
                self._installed[key] = (original, dispatcher, users + 1)
                before[key] = chosen.get(key)
                chosen[key] = fast
        return before

    def leave(self, module: Any, before: dict[tuple[str, str], Any]) -> None:
        chosen = self._chosen()
        with self._lock:
            for key, previous in before.items():
                if previous is None:
                    chosen.pop(key, None)
                else:
                    chosen[key] = previous
                original, dispatcher, users = self._installed[key]
                if users > 1:
                    self._installed[key] = (original, dispatcher, users - 1)
                else:
                    del self._installed[key]
                    setattr(module, key[1], original)

    def _dispatcher(self, key: tuple[str, str], original: Any) -> Any:
        local = self._local

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            chosen = getattr(local, "chosen", None)
            return (chosen.get(key, original) if chosen else original)(*args, **kwargs)

        dispatch.__name__ = key[1]
        dispatch.__wrapped__ = original
        return dispatch


_SWAP = _ModuleSwap()


class FastMath:
    """While entered, the model's mlx-lm module uses the functions above (a no-op for modules
    that do not use mlx-lm's stock `swiglu` / `scaled_dot_product_attention`). With `exp` False
    only what packed passes need, and unfused attention for short prefills (`unfused_keys`) and
    masked decode (`unfused_decode`): the stock kernels for everything else (a GPU's mixed passes,
    prefills and decode)."""

    def __init__(self, model: nn.Module, *, exp: bool = True, unfused_keys: int = 0,
                 unfused_decode: bool = False) -> None:
        from mlx_lm.models import activations, base

        self.module = sys.modules.get(type(model).__module__)
        if exp:
            stock = {"swiglu": (activations.swiglu, swiglu),
                     "scaled_dot_product_attention": (base.scaled_dot_product_attention,
                                                      scaled_dot_product_attention)}
        else:
            stock = {"scaled_dot_product_attention": (base.scaled_dot_product_attention,
                                                      partial(packed_sdpa, unfused_keys=unfused_keys,
                                                              unfused_decode=unfused_decode))}
        self.replaced: dict[str, tuple[Any, Any]] = {}
        if self.module is not None:
            for name, (original, fast) in stock.items():
                if _SWAP.original(self.module, name) is original:
                    self.replaced[name] = (original, fast)
        self.rope_tables = RopeTables()
        self.ropes = _fast_ropes(model, self.rope_tables if exp else None)
        self._depth = 0
        self._before: dict[tuple[str, str], Any] = {}

    @property
    def active(self) -> bool:
        return bool(self.replaced or self.ropes)

    def __enter__(self) -> "FastMath":
        if self._depth == 0:
            if self.replaced:
                self._before = _SWAP.enter(self.module, {name: fast for name, (_, fast) in self.replaced.items()})
            for parent, attr, _, fast in self.ropes:
                parent[attr] = fast
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            if self.replaced:
                _SWAP.leave(self.module, self._before)
            for parent, attr, original, _ in self.ropes:
                parent[attr] = original
            self.rope_tables.clear()


def stand_ins(model: nn.Module, *, fast_math: bool, unfused_keys: int = 0, unfused_decode: bool = False) -> FastMath:
    """What `model`'s passes run under: every fast-math function (the CPU's `engine.fast_math`), else only the
    packed-pass attention, unfused for short prefills (`unfused_keys`) and masked decode (`unfused_decode`).
    The engine's runner and the draft model's proposer (spec) both take theirs from here."""
    if fast_math:
        return FastMath(model)
    return FastMath(model, exp=False, unfused_keys=unfused_keys, unfused_decode=unfused_decode)
