"""Per-row LoRA on the expert projections of mixture-of-experts layers (mlx-lm's switch layers).

An adapter trained by mlx-lm on a MoE model holds, per expert projection (a `SwitchLinear` /
`QuantizedSwitchLinear` inside a `SwitchGLU` or `SwitchMLP`), `lora_a` [E, r, in] and `lora_b`
[E, out, r] (`LoRASwitchLinear`): a token routed to expert e gets scale * (x @ a[e]^T) @ b[e]^T.

The per-row choice of adapter cannot be made at the projection itself: for 64 routed tokens or
more the block sorts them by expert first, and a projection then sees anonymous rows. So the
block is the unit that changes: its class is swapped (once, when the first adapter targeting its
experts loads) for a subclass whose forward is mlx-lm's own plus, per projection, the delta of
each token's adapter (`LoRARouter.plan.apply_switch`). The parameters, their names and the
no-adapter path stay exactly mlx-lm's; a full-weight update sees the same tree.

In a mixed pass the adapters' expert weights are stacked slot-major (A [S*E, in, r], B [S*E, r,
out]) and each routed token's index is slot * E + expert: two `gather_mm` per projection, as
the dense layers' mixed path does per row.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP, _scatter_unsort

from .formats import ModuleLoRA


class Router(Protocol):
    """What a swapped-in block reads of lora.LoRARouter: the pass's plan (None: no adapter rows in it)."""

    plan: Any


SWITCH_LINEARS = (SwitchLinear, QuantizedSwitchLinear)
# a Hugging Face model's per-expert linear (what PEFT adapters name): <block>.experts.<e>.<projection>
_HF_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)$")
_HF_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's names (mlx-lm's sanitize)
Project = Callable[[str, mx.array, mx.array, bool], mx.array]


def switch_dims(linear: nn.Module) -> tuple[int, int, int]:
    """(experts, input features, output features) of a SwitchLinear or QuantizedSwitchLinear."""
    return int(linear.num_experts), int(linear.input_dims), int(linear.output_dims)


def _sort(x: mx.array, indices: mx.array, slots: mx.array | None):
    """mlx-lm's _gather_sort, also carrying each routed token's adapter slot into the sorted order."""
    M = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // M], flat[order], inv_order, None if slots is None else slots.flatten()[order]


class _LoRASwitchBlock:
    """What the swapped-in block classes add: the router and their own path."""

    _lora_router: Router
    _lora_path: str

    def _routed(self, x: mx.array, indices: mx.array, body: Callable[[mx.array, mx.array, bool, Project], mx.array]):
        plan = self._lora_router.plan
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= 64
        slots = None if plan is None else plan.token_slots(indices)
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order, slots = _sort(x, indices, slots)

        def project(name: str, h: mx.array, idx: mx.array, sort: bool) -> mx.array:
            linear = getattr(self, name)
            if plan is None:
                return linear(h, idx, sorted_indices=sort)
            return plan.apply_switch(f"{self._lora_path}.{name}", linear, h, idx, sort, slots)

        out = body(x, idx, do_sort, project)
        if do_sort:
            out = _scatter_unsort(out, inv_order, indices.shape)
        return out.squeeze(-2)


class LoRASwitchGLU(_LoRASwitchBlock, SwitchGLU):
    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        def body(x, idx, sort, project):
            up = project("up_proj", x, idx, sort)
            gate = project("gate_proj", x, idx, sort)
            return project("down_proj", self.activation(up, gate), idx, sort)

        return self._routed(x, indices, body)


class LoRASwitchMLP(_LoRASwitchBlock, SwitchMLP):
    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        def body(x, idx, sort, project):
            return project("fc2", self.activation(project("fc1", x, idx, sort)), idx, sort)

        return self._routed(x, indices, body)


SWAPS = {SwitchGLU: LoRASwitchGLU, SwitchMLP: LoRASwitchMLP}


def routable(block: nn.Module) -> bool:
    """Whether `block`'s expert projections can take per-row adapters (an mlx-lm SwitchGLU / SwitchMLP
    whose forward is mlx-lm's own, possibly already swapped)."""
    return type(block) in SWAPS or isinstance(block, _LoRASwitchBlock)


def enable(block: nn.Module, path: str, router: Router) -> None:
    """Make `block` (at `path` in the model) apply each row's expert adapter from now on."""
    if not isinstance(block, _LoRASwitchBlock):
        block.__class__ = SWAPS[type(block)]
    block._lora_router = router
    block._lora_path = path


def stack_experts(modules: dict, switches: dict[str, nn.Module]) -> dict:
    """`modules` (path -> formats.ModuleLoRA) with per-expert updates of a Hugging Face layout
    (`mlp.experts.3.gate_proj`, PEFT's names) stacked into the expert layer mlx-lm's model holds
    (`mlp.switch_mlp.gate_proj`: a [E, in, r], b [E, r, out]; experts the adapter leaves out get
    zeros). Paths that map to no expert layer are left as they are (the binding names them)."""
    groups: dict[str, dict[int, object]] = {}
    out = {}
    for path, m in modules.items():
        match = _HF_EXPERT.match(path)
        target = None
        if match and m.a.ndim == 2:
            proj = match["proj"]
            target = f"{match['block']}.switch_mlp.{_HF_PROJECTIONS.get(proj, proj)}"
        if target in switches:
            groups.setdefault(target, {})[int(match["e"])] = m
        else:
            out[path] = m
    for target, by_expert in groups.items():
        experts, d_in, d_out = switch_dims(switches[target])
        first = next(iter(by_expert.values()))
        ranks, scales = {m.rank for m in by_expert.values()}, {m.scale for m in by_expert.values()}
        if len(ranks) > 1 or len(scales) > 1 or any(m.m is not None for m in by_expert.values()):
            raise ValueError(f"{target}: the per-expert updates differ in rank or scale, or carry DoRA magnitudes")
        if max(by_expert) >= experts:
            raise ValueError(f"{target}: the adapter updates expert {max(by_expert)} but the layer has {experts}")
        if first.a.shape[0] != d_in or first.b.shape[1] != d_out:
            raise ValueError(f"{target}: the experts' updates map {first.a.shape[0]} -> {first.b.shape[1]} features "
                             f"but the layer maps {d_in} -> {d_out}")
        zeros_a, zeros_b = mx.zeros_like(first.a), mx.zeros_like(first.b)
        a = mx.stack([by_expert[e].a if e in by_expert else zeros_a for e in range(experts)])
        b = mx.stack([by_expert[e].b if e in by_expert else zeros_b for e in range(experts)])
        out[target] = ModuleLoRA(a=a, b=b, scale=first.scale)
    return out


def adopt(model: nn.Module, router: Router) -> list[str]:
    """Blocks an earlier engine on this model swapped: they now answer to `router`. Their paths."""
    paths = []
    for path, module in model.named_modules():
        if isinstance(module, _LoRASwitchBlock):
            module._lora_router = router
            paths.append(path)
    return paths
