"""Sibling projections computed as one matmul (`engine.fused_projections`): q/k/v, gate/up.

A one-row decode step on a GPU is bound by the host launching its kernels (~400 for a 28-layer
Llama; docs/performance.md). A Llama/Qwen/Mistral-style layer projects its input three times for
attention (q_proj, k_proj, v_proj) and twice for its SwiGLU MLP (gate_proj, up_proj); the same
products come out of one matmul against the siblings' weights concatenated along the output axis,
three launches a layer fewer.

The model's classes stay mlx-lm's own (one mechanism for every architecture): each member of a
group becomes an instance of a subclass of its own class (`FusedLinear` of nn.Linear,
`FusedQuantizedLinear` of nn.QuantizedLinear: every isinstance check, attribute and parameter name
unchanged). While a runner's pass is being built (`FusedProjections` entered, this thread only):
- the group's leader (the member the layer calls first) computes the fused product of its input
  and splits it into each member's columns (one Split primitive: views, no kernel);
- a sibling called on the *same* array object returns its columns of that product;
- a sibling called on any other input computes its own product from its own weight, so a layer
  that feeds its siblings different inputs gets exact results, only no saving.
Anywhere else (another thread, a trainer's loss, the draft model, pooling, a compiled trace) every
member is the plain layer it subclasses.

Which groups are fused is proven on the model's own forward, not assumed from its names: names
and shapes only nominate candidates (same parent, same class, input width, dtype, bias,
quantization), then one forward over two tokens, built and never evaluated, records every call
of every candidate; a group is fused only if its members are called in rounds, each member once
per round, all on the same input array, in the same order (the first is the leader). Linears of
other kinds (tensor-parallel slices, expert layers) are never candidates.

Memory: the concatenated arrays are the only copy; each member's `weight` (`scales`, `biases`,
`bias`) is a view into them, so the model's parameter tree, its names and its byte count are what
they were. A member whose array is replaced (a full-weight update by name, `model.load_weights`,
`model.update`) drops the group's concatenation (the old buffer is freed once no member views it);
the next pass concatenates the current arrays again, one group at a time. Adapters: a LoRA
wrapper (parallm.adapters.lora.MultiLoRALinear) calls the member as its base layer and adds the
row's delta to the member's columns, so deltas stay per projection; a merged adapter's projection
does not call its base layer (its siblings then compute their own products in that pass).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from parallm.adapters.lora import MultiLoRALinear

log = logging.getLogger("parallm.engine")

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_ARRAYS = ("weight", "scales", "biases", "bias")


class _Pass(threading.local):
    cache: dict | None = None  # group -> (input, each member's part) while a pass is built in this thread
    probe: list | None = None  # (group, member slot, input) calls while the install probe runs


_PASS = _Pass()


class _Member:
    """What FusedLinear and FusedQuantizedLinear add to their base class."""

    _fused_group: "FusedGroup | None" = None
    _fused_slot: int = 0

    def __call__(self, x: mx.array) -> mx.array:
        group = self._fused_group
        if group is not None:
            cache = _PASS.cache
            if cache is not None and group.on:
                y = group.project(self._fused_slot, x, cache)
                if y is not None:
                    return y
            elif _PASS.probe is not None:
                _PASS.probe.append((group, self._fused_slot, x))
        return super().__call__(x)  # type: ignore[misc]

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)  # type: ignore[misc]
        group = self._fused_group
        if group is not None and key in _ARRAYS:
            group.invalidate()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)  # type: ignore[misc]
        group = self._fused_group
        if group is not None and key in _ARRAYS:
            group.invalidate()


class FusedLinear(_Member, nn.Linear):
    """An nn.Linear that is a member of a fused group (see the module docstring)."""


class FusedQuantizedLinear(_Member, nn.QuantizedLinear):
    """An nn.QuantizedLinear that is a member of a fused group (see the module docstring)."""


_STAND_IN = {nn.Linear: FusedLinear, nn.QuantizedLinear: FusedQuantizedLinear}
_PLAIN = {v: k for k, v in _STAND_IN.items()}


def _signature(layer: nn.Module) -> tuple | None:
    """What members of one group must share; None for a layer that cannot be a member."""
    cls = _PLAIN.get(type(layer), type(layer))
    if cls not in _STAND_IN or layer.get("weight") is None or layer["weight"].ndim != 2:
        return None
    present = tuple(k for k in _ARRAYS if layer.get(k) is not None)
    if cls is nn.Linear:
        return cls, layer["weight"].shape[1], layer["weight"].dtype, present
    return (cls, layer["weight"].shape[1], layer["weight"].dtype, layer["scales"].dtype, present,
            layer.group_size, layer.bits, getattr(layer, "mode", "affine"))


def _base_layer(child: Any) -> nn.Module | None:
    """The linear layer at a child slot: itself, or the base an adapter wrapper holds."""
    if isinstance(child, MultiLoRALinear):
        return child.get("linear")
    return child if isinstance(child, nn.Module) else None


class FusedGroup:
    """Sibling projections of one input: their arrays concatenated along the output axis, each
    member's arrays views into them."""

    def __init__(self, path: str, members: list[nn.Module]) -> None:
        self.path = path
        self.members = members
        self.quantized = isinstance(members[0], nn.QuantizedLinear)
        self.on = False
        self.leader = 0
        self.bounds: list[tuple[int, int]] = []
        self.splits: list[int] = []
        self._fused: dict[str, mx.array] | None = None
        self.builds = 0

    def invalidate(self) -> None:
        self._fused = None

    def attach(self) -> None:
        for slot, m in enumerate(self.members):
            m.__class__ = _STAND_IN[_PLAIN.get(type(m), type(m))]
            m._fused_group, m._fused_slot = self, slot

    def detach(self) -> None:
        self.on = False
        self._fused = None
        for m in self.members:
            if m._fused_group is self:
                m.__class__ = _PLAIN[type(m)]
                del m._fused_group, m._fused_slot

    def build(self) -> dict[str, mx.array] | None:
        """Concatenate the members' current arrays (evaluated now) and make each member's arrays views of
        them; None (and the group off) when the members no longer match (an array removed or recast)."""
        members = self.members
        sig = _signature(members[0])
        if sig is None or any(_signature(m) != sig for m in members[1:]):
            log.info("fused projections: %s off, its members no longer match", self.path)
            self.on = False
            return None
        keys = [k for k in _ARRAYS if members[0].get(k) is not None]
        fused = {k: mx.concatenate([m[k] for m in members], axis=0) for k in keys}
        mx.eval(list(fused.values()))
        bounds, lo = [], 0
        for m in members:
            hi = lo + int(m["weight"].shape[0])
            bounds.append((lo, hi))
            lo = hi
        views = []
        for m, (lo, hi) in zip(members, bounds):
            for k in keys:
                view = fused[k][lo:hi]
                dict.__setitem__(m, k, view)  # not the member's __setitem__: this is no replacement
                views.append(view)
        mx.eval(views)
        if not self.quantized:
            fused["weight_t"] = fused["weight"].T
            mx.eval(fused["weight_t"])
        self.bounds = bounds
        self.splits = [hi for _, hi in bounds[:-1]]
        self._fused = fused
        self.builds += 1
        return fused

    def _product(self, x: mx.array) -> mx.array | None:
        f = self._fused or self.build()
        if f is None:
            return None
        if self.quantized:
            lead = self.members[0]
            y = mx.quantized_matmul(x, f["weight"], scales=f["scales"], biases=f.get("biases"), transpose=True,
                                    group_size=lead.group_size, bits=lead.bits, mode=getattr(lead, "mode", "affine"))
            return y + f["bias"] if "bias" in f else y
        return mx.addmm(f["bias"], x, f["weight_t"]) if "bias" in f else x @ f["weight_t"]

    def project(self, slot: int, x: mx.array, cache: dict) -> mx.array | None:
        """Member `slot`'s output for `x` from the fused product (the leader computes it); None: the
        member computes its own (a sibling called on another input than its leader's last)."""
        if slot == self.leader:
            y = self._product(x)
            if y is None:
                return None
            parts = mx.split(y, self.splits, axis=-1)  # one primitive, a view per member
            cache[self] = (x, parts)
            return parts[slot]
        hit = cache.get(self)
        return hit[1][slot] if hit is not None and hit[0] is x else None


def _candidates(model: nn.Module) -> list[FusedGroup]:
    groups = []
    for path, parent in model.named_modules():
        children = parent.children() if isinstance(parent, nn.Module) else {}
        for names in GROUPS:
            layers = [_base_layer(children.get(n)) for n in names]
            if any(m is None for m in layers):
                continue
            old = layers[0].__dict__.get("_fused_group")
            if old is not None and len(old.members) == len(layers) and all(a is b for a, b in zip(old.members, layers)):
                groups.append(old)  # installed by an earlier engine on this model
                continue
            sig = _signature(layers[0])
            if sig is None or any(_signature(m) != sig for m in layers[1:]) or \
                    any(m.__dict__.get("_fused_group") is not None for m in layers):
                continue
            groups.append(FusedGroup(f"{path}.{'/'.join(names)}" if path else "/".join(names), layers))
    return groups


def _probe(model: nn.Module, groups: list[FusedGroup]) -> str:
    """Record one forward's calls of the members and switch on the groups called as the module
    docstring says; returns why none could be checked ("" when the forward ran)."""
    from mlx_lm.models.cache import make_prompt_cache

    calls: list = []
    _PASS.probe = calls
    try:
        model(mx.array([[1, 2]], dtype=mx.int32), cache=make_prompt_cache(model))
    except Exception as exc:  # noqa: BLE001 - a model whose forward needs more than tokens: nothing fused
        return f"{type(exc).__name__}: {exc}"
    finally:
        _PASS.probe = None
    seen: dict[FusedGroup, list] = {}
    for group, slot, x in calls:
        seen.setdefault(group, []).append((slot, x))
    for group in groups:
        order = _rounds(seen.get(group, []), len(group.members))
        if order is not None:
            group.leader = order[0]
            group.on = True
    return ""


def _rounds(calls: list, n: int) -> list[int] | None:
    """The members' call order when `calls` are whole rounds (each member once, one input array per
    round, the same order every round); else None."""
    if not calls or len(calls) % n:
        return None
    order = [slot for slot, _ in calls[:n]]
    if sorted(order) != list(range(n)):
        return None
    for start in range(0, len(calls), n):
        rnd = calls[start:start + n]
        if [slot for slot, _ in rnd] != order or any(x is not rnd[0][1] for _, x in rnd):
            return None
    return order


class FusedProjections:
    """The fused groups of one model; entered around the passes that use them (this thread only)."""

    def __init__(self, model: nn.Module) -> None:
        self.groups = _candidates(model)
        fresh = [g for g in self.groups if not g.on]
        for g in fresh:
            g.attach()
        why = _probe(model, fresh) if fresh else ""
        for g in fresh:
            if g.on:
                g.build()
            else:
                g.detach()
        self.groups = [g for g in self.groups if g.on]
        if why:
            log.info("fused projections off: the probe forward failed (%s)", why)
        else:
            log.info("fused projections: %d groups (%d candidates)", len(self.groups), len(fresh) or len(self.groups))
        self._saved: list[dict | None] = []

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def __enter__(self) -> "FusedProjections":
        self._saved.append(_PASS.cache)
        _PASS.cache = {}
        return self

    def __exit__(self, *exc: Any) -> None:
        _PASS.cache = self._saved.pop()

    def remove(self) -> None:
        """Every member back to its plain class (its arrays stay views of the concatenation)."""
        for g in self.groups:
            g.detach()
        self.groups = []
