"""The adapter router's plan of a pass as inputs of a compiled decode pass (engine/compiled.py).

A bound plan (parallm.adapters.lora: `_Single`, one adapter for every row; `_Mixed`, a slot per row
into per-layer stacks) reads adapter arrays that are not in the model's tree, so a compiled pass
must take them as inputs, or it would keep the first adapter's arrays as constants. `capture`
collects what the plan reads, outside the trace (building any stacks eagerly), as a signature —
which layers, merged or factored, DoRA or not, each factored layer's scale, the number of
slots — and a flat list of arrays; inside the trace `rebuild` makes a plan of the same kind that
reads the traced arrays. A new version of an adapter with the same signature (a trainer's
next step) runs in the same trace; other shapes retrace (MLX keys a trace on its inputs' shapes).
Expert (MoE) projections under an adapter are not captured: such a pass runs eagerly.
"""

from __future__ import annotations

from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn

from parallm.adapters.lora import LoRARouter, MultiLoRALinear, PreparedLoRA, _Mixed, _Single

Captured = tuple[tuple, list[mx.array]]


class AdaptedLayers:
    """The model's adapter-wrapped linear layers by path (refreshed when a plan names one not seen:
    loading an adapter wraps more layers)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linears: dict[str, nn.Module] = {}

    def covers(self, paths: Iterable[str]) -> bool:
        paths = list(paths)
        if all(p in self.linears for p in paths):
            return True
        self.linears = {m._path: m.linear for _, m in self.model.named_modules() if isinstance(m, MultiLoRALinear)}
        return all(p in self.linears for p in paths)


def capture(router: LoRARouter, layers: AdaptedLayers) -> Captured | None:
    """(signature, arrays) of the router's bound plan; None when a pass under it cannot be compiled."""
    plan = router.plan
    if plan is None:
        return ("base",), []
    if isinstance(plan, _Single):
        adapter = plan.adapter
        if not layers.covers(adapter.modules):
            return None
        sig: list[tuple] = []
        arrays: list[mx.array] = []
        for path in sorted(adapter.modules):
            m = adapter.modules[path]
            if m.merged is not None:
                sig.append((path, "merged"))
                arrays.append(m.merged)
                continue
            dora = m.m is not None
            sig.append((path, "dora" if dora else "lora", float(m.scale)))
            arrays += [m.a, m.b] + ([adapter.gains[path]] if dora else [])
        return ("single", tuple(sig)), arrays
    if isinstance(plan, _Mixed):
        stacks = plan.stacks
        if not layers.covers(p for a in stacks.slots if a is not None for p in a.modules):
            return None
        sig, arrays = [], [plan.idx]
        for path in sorted(layers.linears):
            entry = stacks.get(path, layers.linears[path])
            if entry is None:
                continue
            A, B, gains = entry
            sig.append((path, gains is not None))
            arrays += [A, B] + ([gains] if gains is not None else [])
        return ("mixed", len(stacks.slots), tuple(sig)), arrays
    return None


class _Adapter:
    """What `_Single` reads of a LoadedAdapter."""

    def __init__(self) -> None:
        self.modules: dict[str, PreparedLoRA] = {}
        self.gains: dict[str, mx.array] = {}


class _StackTable:
    """What `_Mixed` reads of its stacks (dense layers only)."""

    def __init__(self, entries: dict[str, tuple]) -> None:
        self.entries = entries

    def get(self, path: str, linear: nn.Module) -> tuple | None:
        return self.entries.get(path)


def rebuild(signature: tuple, arrays: list[Any]) -> _Single | _Mixed | None:
    """The plan `capture` described, reading `arrays` (the traced inputs)."""
    kind = signature[0]
    if kind == "base":
        return None
    it = iter(arrays)
    if kind == "single":
        adapter = _Adapter()
        for entry in signature[1]:
            path, form = entry[0], entry[1]
            if form == "merged":
                adapter.modules[path] = PreparedLoRA(a=None, b=None, scale=0.0, merged=next(it))
                continue
            a, b = next(it), next(it)
            gain = next(it) if form == "dora" else None
            if gain is not None:
                adapter.gains[path] = gain
            adapter.modules[path] = PreparedLoRA(a=a, b=b, scale=entry[2], m=gain)
        return _Single(adapter)
    idx = next(it)
    entries = {}
    for path, dora in signature[2]:
        A, B = next(it), next(it)
        entries[path] = (A, B, next(it) if dora else None)
    return _Mixed(_StackTable(entries), idx, nslots=signature[1])
