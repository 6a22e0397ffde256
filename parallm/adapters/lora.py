"""Per-row LoRA in mixed batches: a wrapper around the model's own linear layers.

The mlx-lm model stays unmodified apart from its targeted nn.Linear / nn.QuantizedLinear
layers, which are wrapped (once, when the first adapter targeting them loads) in
`MultiLoRALinear`: `base(x)` plus the LoRA delta of each row's adapter. Which adapter each row
uses is set by the runner before a forward pass (`LoRARouter.bind`) and cleared after it, so
the graph of a pass is fixed when it is built: a new adapter version changes the next pass,
never one already launched (MLX arrays are immutable; a launched graph keeps its own).

Three cases per pass:
- no row has an adapter: the wrapper returns base(x) (one attribute check);
- every row has the same adapter: x @ W'^T with the update merged into a copy of the base weight
  when the adapter has one (`PreparedLoRA.merged`: the pass then costs what the base model's
  does), else base(x) + scale * (x @ a) @ b as one matmul and one addmm;
- mixed: the adapters of the pass (plus a zero slot when some rows have none) are laid side by
  side along the rank per layer, A [in, S*r], B [S*r, out] (ranks zero-padded to the set's
  largest, each slot's B times its scale), and the update is `((x @ A) * mask) @ B`: two dense
  matmuls and a multiply per layer, `mask` [rows, S*r] (each row's own slot's columns) made once
  per pass. Stacks are cached per set of adapters, slots in a fixed order (rows move as others
  finish; the same set must find the same stacks), so a steady mix costs no copies after its
  first pass. The same plan serves a packed pass (runner.mixed) with a slot per token.
DoRA rows are rescaled by their precomputed magnitude / norm gain per output feature.
Expert projections of MoE layers take the same three cases through `apply_switch`
(parallm.adapters.switch_lora: the stacks there are per (slot, expert)).

On a GPU a small model's pass is spent launching kernels, not running them, so the number of
ops per adapted layer is what an adapter costs there (docs/adapters.md, "Measured").
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from parallm.protocol import AdapterVersion

from .sharded import ShardedBase, is_sharded
from .switch_lora import switch_dims

_uids = itertools.count(1)

STACK_CACHE_SETS = 8
DENSE_COLUMNS = 256  # slots x rank up to which a mixed pass's update is dense; past it, per-row gather_mm


def linear_dims(linear: nn.Module) -> tuple[int, int]:
    """(input features, output features) of an nn.Linear or nn.QuantizedLinear."""
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return int(in_dims), int(out_dims)


def dense_weight(linear: nn.Module) -> mx.array:
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(linear.weight, linear.scales, linear.biases, group_size=linear.group_size,
                             bits=linear.bits, mode=getattr(linear, "mode", "affine"))
    return linear.weight


def compute_dtype(linear: nn.Module) -> mx.Dtype:
    quantized = isinstance(linear, (nn.QuantizedLinear, QuantizedSwitchLinear))
    return linear.scales.dtype if quantized else linear.weight.dtype


@dataclass(frozen=True, slots=True)
class PreparedLoRA:
    """One layer's update as passes apply it: delta = scale * (x @ a) @ b."""

    a: mx.array  # [in, r], the layer's compute dtype
    b: mx.array  # [r, out]
    scale: float
    m: mx.array | None = None  # DoRA magnitude [out] (float32)
    merged: mx.array | None = None  # [out, in]: the base weight with the update (and DoRA gain) folded in

    @property
    def rank(self) -> int:
        return int(self.a.shape[-1])

    @property
    def experts(self) -> bool:
        """Whether this is an expert projection's update: a [E, in, r], b [E, r, out]."""
        return self.a.ndim == 3

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.a, self.b, self.m, self.merged) if x is not None)


@dataclass(eq=False, slots=True)
class LoadedAdapter:
    """One loaded version of an adapter: its prepared updates per module (the registry, registry.py,
    keeps them by name and version; passes bind them to rows)."""

    name: str
    version: int
    kind: str
    format: str
    rank: int
    modules: dict[str, PreparedLoRA]
    gains: dict[str, mx.array] = field(default_factory=dict)
    nbytes: int = 0
    source: str = "inline"
    loaded_at: float = 0.0
    uid: int = field(default_factory=lambda: next(_uids))
    first_token_at: float = 0.0  # when the engine read the first token sampled under this version
    experts: bool = False  # it updates expert (MoE) layers

    @property
    def identity(self) -> str:
        """The prefix-cache identity: name and version."""
        return f"{self.name}@{self.version}"

    @property
    def merged(self) -> bool:
        """Whether its updates are folded into copies of the base weights (see lora.py)."""
        return any(m.merged is not None for m in self.modules.values())

    def describe(self) -> AdapterVersion:
        return AdapterVersion(version=self.version, kind=self.kind, format=self.format, rank=self.rank,
                              modules=len(self.modules), bytes=self.nbytes, merged=self.merged, source=self.source,
                              loaded_at=self.loaded_at)


class MultiLoRALinear(nn.Module):
    """base(x) + the LoRA delta of each row's adapter for this pass (see module docstring)."""

    def __init__(self, linear: nn.Module, path: str, router: "LoRARouter") -> None:
        super().__init__()
        self.linear = linear
        self._path = path
        self._router = router
        self._shard = ShardedBase(linear) if is_sharded(linear) else None  # a tensor-parallel slice (sharded.py)

    def __call__(self, x: mx.array) -> mx.array:
        return self._apply(self._router.plan, x)

    def at_positions(self, picked: mx.array, rows: mx.array, length: int) -> mx.array:
        """self over `picked`, the positions `rows` of the pass's flattened [batch x length] positions
        ([1, len(rows), in]: engine.head projects only the positions it samples); a mixed pass's
        slots, per row or per packed token, follow the positions picked."""
        plan = self._router.plan
        if isinstance(plan, _Mixed):
            plan = plan.at_positions(rows, length)
        return self._apply(plan, picked)

    def _apply(self, plan: "_Single | _Mixed | None", x: mx.array) -> mx.array:
        if plan is None:
            return self.linear(x)
        if self._shard is not None:
            return self._shard.finish(plan.apply(self._path, self._shard.local(), x))
        return plan.apply(self._path, self.linear, x)


def _dora(y: mx.array, linear: nn.Module, gain: mx.array) -> mx.array:
    """mlx-lm's DoRA: gain * (x W^T + delta) + bias, given y = x W^T + bias + delta."""
    if "bias" in linear:
        return (y - linear.bias) * gain.astype(y.dtype) + linear.bias
    return y * gain.astype(y.dtype)


class _Single:
    def __init__(self, adapter: LoadedAdapter) -> None:
        self.adapter = adapter

    def apply(self, path: str, linear: nn.Module, x: mx.array) -> mx.array:
        m = self.adapter.modules.get(path)
        if m is None:
            return linear(x)
        if m.merged is not None:
            return mx.addmm(linear.bias, x, m.merged.T) if "bias" in linear else x @ m.merged.T
        y = mx.addmm(linear(x), x @ m.a, m.b, alpha=m.scale)
        if m.m is not None:
            y = _dora(y, linear, self.adapter.gains[path])
        return y

    def token_slots(self, indices: mx.array) -> None:
        return None

    def apply_switch(self, path: str, linear: nn.Module, x: mx.array, idx: mx.array, sort: bool,
                     slots: None) -> mx.array:
        """mlx-lm's LoRASwitchLinear, operation for operation."""
        y = linear(x, idx, sorted_indices=sort)
        m = self.adapter.modules.get(path)
        if m is None:
            return y
        z = mx.gather_mm(x, m.a, rhs_indices=idx, sorted_indices=sort)
        z = mx.gather_mm(z, m.b, rhs_indices=idx, sorted_indices=sort)
        return y + (m.scale * z).astype(x.dtype)


class _Stacks:
    """A set of adapters stacked per layer path, built lazily and kept for later passes."""

    def __init__(self, slots: list[LoadedAdapter | None]) -> None:
        self.slots = slots
        self.rank = max((m.rank for a in slots if a is not None for m in a.modules.values()), default=1)
        self.by_path: dict[str, tuple | None] = {}

    def _modules(self, path: str) -> list | None:
        """Each slot's adapter module at `path` (None where a slot has none), or None when no slot
        adapts it (remembered, as the built stacks are)."""
        mods = [None if a is None else a.modules.get(path) for a in self.slots]
        if all(m is None for m in mods):
            self.by_path[path] = None
            return None
        return mods

    def get(self, path: str, linear: nn.Module) -> tuple | None:
        """(A [in, S*r], B [S*r, out], DoRA gains [S, out] or None) of a dense layer: slot s owns
        columns / rows s*r .. s*r+r (its rank zero-padded to the set's largest), B times its scale;
        a slot without an update at `path` (or the base model's slot) is zeros. Past
        DENSE_COLUMNS (the dense update's cost grows with S, a gather's does not): A [S, in, r],
        B [S, r, out]."""
        if path in self.by_path:
            return self.by_path[path]
        if (mods := self._modules(path)) is None:
            return None
        in_dims, out_dims = linear_dims(linear)
        dtype = next(m.a.dtype for m in mods if m is not None)
        r = self.rank
        A, B, scales, gains = [], [], [], []
        any_dora = any(m is not None and m.m is not None for m in mods)
        for adapter, m in zip(self.slots, mods):
            if m is None:
                A.append(mx.zeros((in_dims, r), dtype))
                B.append(mx.zeros((r, out_dims), dtype))
                scales.append(0.0)
                gains.append(mx.ones((out_dims,), mx.float32))
                continue
            pad = r - m.rank
            A.append(m.a if not pad else mx.pad(m.a, [(0, 0), (0, pad)]))
            B.append(m.b if not pad else mx.pad(m.b, [(0, pad), (0, 0)]))
            scales.append(m.scale)
            gains.append(adapter.gains[path].astype(mx.float32) if m.m is not None else mx.ones((out_dims,), mx.float32))
        gain = mx.stack(gains) if any_dora else None
        if len(self.slots) * r > DENSE_COLUMNS:  # many adapters: per-row gather_mm, [S, in, r] / [S, r, out]
            B_scaled = (mx.stack(B) * mx.array(scales, dtype=mx.float32)[:, None, None]).astype(dtype)
            entry = (mx.stack(A), B_scaled, gain)
        else:
            row_scales = mx.repeat(mx.array(scales, dtype=mx.float32), r)[:, None]
            entry = (mx.concatenate(A, axis=1), (mx.concatenate(B, axis=0) * row_scales).astype(dtype), gain)
        self.by_path[path] = entry
        return entry

    def get_switch(self, path: str, linear: nn.Module) -> tuple | None:
        """(A [S*E, in, r], B [S*E, r, out], scale per (slot, expert) [S*E]) of an expert projection."""
        if path in self.by_path:
            return self.by_path[path]
        if (mods := self._modules(path)) is None:
            return None
        experts, in_dims, out_dims = switch_dims(linear)
        dtype = next(m.a.dtype for m in mods if m is not None)
        r = max(m.rank for m in mods if m is not None)
        A, B, scales = [], [], []
        for m in mods:
            if m is None:
                A.append(mx.zeros((experts, in_dims, r), dtype))
                B.append(mx.zeros((experts, r, out_dims), dtype))
                scales.append(0.0)
                continue
            pad = r - m.rank
            A.append(m.a if not pad else mx.pad(m.a, [(0, 0), (0, 0), (0, pad)]))
            B.append(m.b if not pad else mx.pad(m.b, [(0, 0), (0, pad), (0, 0)]))
            scales.append(m.scale)
        entry = (mx.concatenate(A), mx.concatenate(B), mx.repeat(mx.array(scales, dtype=dtype), experts))
        self.by_path[path] = entry
        return entry


class _Mixed:
    """Rows (or, in a packed pass, tokens) of several adapters: `idx` [n] is each one's slot in the
    stacks. A dense layer adds `((x @ A) * mask) @ B` with the stacks' slots side by side along the
    rank (A [in, S*r], B [S*r, out]) and `mask` [n, S*r] keeping each row's own slot's columns: two
    dense matmuls and a multiply, the mask made once per pass and shared by every layer. Sets too
    wide for that (`DENSE_COLUMNS`) take two per-row `gather_mm` instead."""

    def __init__(self, stacks: "_Stacks", idx: mx.array, nslots: int | None = None, packed: bool = False) -> None:
        self.stacks = stacks
        self.idx = idx
        self.nslots = len(stacks.slots) if nslots is None else nslots
        self.packed = packed  # idx is per token of one packed row [1, n, ...] (runner.mixed)
        self._masks: dict[tuple, mx.array] = {}
        self._where: dict[int, mx.array] = {}

    def _lead(self, ndim: int) -> mx.array:
        """idx shaped to broadcast over an activation of `ndim` dimensions ([n, 1, ...] or [1, n])."""
        got = self._where.get(ndim)
        if got is None:
            n = self.idx.shape[0]
            shape = (1, n) + (1,) * (ndim - 3) if self.packed else (n,) + (1,) * (ndim - 2)
            got = self._where[ndim] = self.idx.reshape(shape)
        return got

    def _mask(self, ndim: int, cols: int, dtype: mx.Dtype) -> mx.array:
        key = (ndim, cols, dtype)
        got = self._masks.get(key)
        if got is None:
            slot_of_col = mx.arange(cols, dtype=mx.uint32) // (cols // self.nslots)
            got = self._masks[key] = (self._lead(ndim)[..., None] == slot_of_col).astype(dtype)
        return got

    def apply(self, path: str, linear: nn.Module, x: mx.array) -> mx.array:
        y = linear(x)
        st = self.stacks.get(path, linear)
        if st is None:
            return y
        A, B, gains = st
        if A.ndim == 2:
            y = mx.addmm(y, (x @ A) * self._mask(x.ndim, A.shape[-1], x.dtype), B)
        elif self.packed:  # tokens of one row: each token its own gather_mm batch entry
            t = x.swapaxes(0, 1)
            y = y + mx.gather_mm(mx.gather_mm(t, A, rhs_indices=self.idx), B, rhs_indices=self.idx).swapaxes(0, 1)
        else:
            y = y + mx.gather_mm(mx.gather_mm(x, A, rhs_indices=self.idx), B, rhs_indices=self.idx)
        if gains is not None:
            y = _dora(y, linear, gains[self._lead(y.ndim)])
        return y

    def at_positions(self, rows: mx.array, length: int) -> "_Mixed":
        """This plan over positions `rows` of the pass's flattened [batch x `length`] positions (or a
        packed row's tokens), laid out as a packed row [1, len(rows)]: a slot per position picked."""
        per = self.idx[rows] if self.packed else self.idx[rows // length]
        return _Mixed(self.stacks, per, self.nslots, packed=True)

    def token_slots(self, indices: mx.array) -> mx.array:
        """The stack slot of every routed token: `indices` [rows, ..., k] as the pass's rows, or
        [rows * tokens, k] when the model flattened its rows first (olmoe, minimax_m3)."""
        if self.packed:
            raise ValueError("expert-layer adapters cannot share a packed pass (lora.packable)")
        rows, n = self.idx.shape[0], indices.shape[0]
        if n == rows:
            per = self.idx
        elif n % rows == 0:
            per = mx.repeat(self.idx, n // rows)
        else:
            raise ValueError(f"a MoE layer routed {n} leading rows in a pass of {rows}: which row each token "
                             "belongs to is unknown")
        return mx.broadcast_to(per.reshape((n,) + (1,) * (indices.ndim - 1)), indices.shape)

    def apply_switch(self, path: str, linear: nn.Module, x: mx.array, idx: mx.array, sort: bool,
                     slots: mx.array) -> mx.array:
        y = linear(x, idx, sorted_indices=sort)
        st = self.stacks.get_switch(path, linear)
        if st is None:
            return y
        A, B, scales = st
        comb = slots * linear.num_experts + idx
        z = mx.gather_mm(mx.gather_mm(x, A, rhs_indices=comb), B, rhs_indices=comb)
        return y + (scales[comb].reshape(comb.shape + (1, 1)) * z).astype(x.dtype)


def packable(adapters: Sequence[LoadedAdapter | None]) -> bool:
    """Whether rows under these adapters can share one packed pass (tokens of several rows in one
    sequence, runner.mixed): one adapter (or none) for all, or no adapter with expert-layer
    updates (an MoE block sorts its tokens by expert, and their slots are per row)."""
    first = adapters[0] if adapters else None
    if all(a is first for a in adapters):
        return True
    return not any(a.experts for a in adapters if a is not None)


class LoRARouter:
    """Which adapter each batch row uses during the pass being built; None outside passes."""

    def __init__(self) -> None:
        self.plan: _Single | _Mixed | None = None
        self._stacks: OrderedDict[tuple, _Stacks] = OrderedDict()
        self.passes = {"base": 0, "single": 0, "mixed": 0}

    def bind(self, adapters: Sequence[LoadedAdapter | None], packed: bool = False) -> None:
        """The plan of the pass being built: `adapters[i]` is row i's (None: the base model); with
        `packed`, token i's of a packed pass's one row (runner.mixed; see `packable`)."""
        distinct: dict[int, LoadedAdapter] = {}
        has_base = False
        for a in adapters:
            if a is None:
                has_base = True
            else:
                distinct.setdefault(a.uid, a)
        if not distinct:
            self.plan = None
            self.passes["base"] += 1
        elif len(distinct) == 1 and not has_base:
            self.plan = _Single(next(iter(distinct.values())))
            self.passes["single"] += 1
        else:
            # slots in uid order, whatever the rows' order: rows move as others finish, and the same
            # set of versions must find the same stacks
            key = ((0,) if has_base else ()) + tuple(sorted(distinct))
            stacks = self._stacks.get(key)
            if stacks is None:
                stacks = self._stacks[key] = _Stacks([None if uid == 0 else distinct[uid] for uid in key])
                while len(self._stacks) > STACK_CACHE_SETS:
                    self._stacks.popitem(last=False)
            else:
                self._stacks.move_to_end(key)
            where = {uid: i for i, uid in enumerate(key)}
            idx = mx.array([where[0 if a is None else a.uid] for a in adapters], dtype=mx.uint32)
            self.plan = _Mixed(stacks, idx, packed=packed)
            self.passes["mixed"] += 1

    def unbind(self) -> None:
        self.plan = None

    def forget(self, uid: int) -> None:
        """Drop cached stacks holding adapter `uid` (it was unloaded and no row uses it)."""
        for key in [k for k in self._stacks if uid in k]:
            del self._stacks[key]

    @property
    def stack_bytes(self) -> int:
        total = 0
        for st in self._stacks.values():
            for entry in st.by_path.values():
                if entry is not None:
                    total += sum(a.nbytes for a in entry if a is not None)
        return total
