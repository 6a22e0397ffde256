"""Named adapters with integer versions, bound to one base model.

`AdapterManager.load()` parses an adapter (parallm.adapters.formats), checks it against the base
model, prepares its weights (cast to the layer's compute type, DoRA gains) and only then
commits it: a bad adapter raises AdapterError and nothing serving changes. Versions are
monotonic per name; the last `history` versions of each name are kept. A sequence holds its
own reference to the LoadedAdapter it runs under, so dropping a version from the registry never
pulls weights from under a running sequence (they are freed when it finishes).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from parallm.protocol import AdapterInfo, AdapterStats

from .errors import AdapterError
from .formats import Format, ParsedAdapter, nonfinite_names, parse, read_dir
from .lora import LoadedAdapter, LoRARouter, MultiLoRALinear, PreparedLoRA, compute_dtype, dense_weight, linear_dims
from .sharded import is_sharded, local_linear, shard_lora
from .switch_lora import SWITCH_LINEARS, adopt, enable, routable, stack_experts, switch_dims

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class AdapterManager:
    def __init__(self, model: nn.Module, *, history: int = 4, merge_mb: int = 256) -> None:
        """`merge_mb`: a version whose targeted layers are dense also gets copies of their weights
        with its update folded in when those copies take at most this many MiB (0: never), so a
        pass where every row runs under it costs what the base model's does."""
        self.model = model
        self.history = max(1, int(history))
        self.merge_bytes = max(0, int(merge_mb)) << 20
        self.router = LoRARouter()
        self.versions: dict[str, list[LoadedAdapter]] = {}
        self.linears: dict[str, nn.Module] = {}
        self.switches: dict[str, nn.Module] = {}  # expert projections of routable MoE blocks (switch_lora)
        self.other_modules: dict[str, str] = {}
        self.wrapped: set[str] = set()
        self.switch_blocks: set[str] = set(adopt(model, self.router))
        modules = model.named_modules()
        by_path = dict(modules)
        for path, module in modules:
            if isinstance(module, MultiLoRALinear):  # wrapped by an earlier engine on this model: take it over
                module._router = self.router
                self.linears[path] = module.linear
                self.wrapped.add(path)
        for path, module in modules:
            if path in self.wrapped or path.endswith(".linear") and path[:-len(".linear")] in self.wrapped:
                continue
            if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
                self.linears[path] = module
            elif isinstance(module, SWITCH_LINEARS) and "." in path:
                block = by_path[path.rsplit(".", 1)[0]]
                if routable(block):
                    self.switches[path] = module
                else:
                    self.other_modules[path] = (f"{type(module).__name__} inside a {type(block).__name__} (a MoE "
                                                "block whose forward the engine cannot route per row)")
            elif path:
                self.other_modules[path] = type(module).__name__
        # a tensor-parallel engine's slices of linear layers (sharded.py): adapters are checked against,
        # and prepared for, this rank's part, `linears` holding a plain linear that shares its arrays
        self.sharded = {p: m for p, m in [*self.linears.items(), *modules] if is_sharded(m) and
                        (p in self.linears or p in self.other_modules)}
        for p, layer in self.sharded.items():
            self.other_modules.pop(p, None)
            self.linears[p] = local_linear(layer)
        dtypes = {compute_dtype(linear) for linear in [*self.linears.values(), *self.switches.values()]}
        # one compute type for every layer: safetensors bytes are cast to it per dtype group as they're read
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None
        layers = getattr(model, "layers", None)
        self.num_layers = len(layers) if layers is not None else 0
        self.published = 0
        self.rejected = 0
        self.default_name = ""  # what requests naming no adapter run under ("": the base model)
        # Adapters are parsed, checked and cast on their own stream: an evaluation on the default
        # stream would first wait for the decode pass the engine keeps in flight (a whole step on
        # a busy GPU; ~1 ms loads took ~7 ms in the served engine on a CPU). MLX streams belong to
        # the thread that made them, so there is one per loading thread.
        self._local = threading.local()

    # ------------------------------------------------------------------ queries
    def latest(self, name: str) -> LoadedAdapter | None:
        got = self.versions.get(name)
        return got[-1] if got else None

    def policy(self) -> dict[str, int]:
        """{name: latest version}; the base model is "" at version 0. (Which version a request runs
        under is decided by policy.VersionPolicy.)"""
        return {"": 0, **{name: vs[-1].version for name, vs in self.versions.items() if vs}}

    def describe(self) -> list[AdapterInfo]:
        return [AdapterInfo(name=name, latest=vs[-1].version, versions=[a.describe() for a in vs],
                            bytes=sum(a.nbytes for a in vs)) for name, vs in sorted(self.versions.items()) if vs]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for vs in self.versions.values() for a in vs)

    def stats(self) -> AdapterStats:
        return AdapterStats(loaded=sum(1 for vs in self.versions.values() if vs),
                            versions_kept=sum(len(vs) for vs in self.versions.values()), bytes=self.nbytes,
                            stack_bytes=self.router.stack_bytes, publishes=self.published, rejected=self.rejected,
                            latest={name: vs[-1].version for name, vs in self.versions.items() if vs},
                            passes=dict(self.router.passes))

    # ------------------------------------------------------------------ changes
    def load(self, name: str, *, config: dict[str, Any] | None = None, weights: bytes | dict | None = None,
             path: str = "", fmt: Format = "auto", version: int = 0) -> LoadedAdapter:
        """Validate and add a version of adapter `name`; returns it. AdapterError leaves everything as it was."""
        try:
            with mx.stream(self._load_stream()):
                adapter = self._prepare(name, config, weights, path, fmt, version)
        except AdapterError:
            self.rejected += 1
            raise
        self._commit(adapter)
        return adapter

    def _load_stream(self) -> mx.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = mx.new_stream(mx.default_device())
        return stream

    def set_default(self, name: str) -> None:
        """Requests that name no adapter run under `name`'s latest version from now on ("" = the base
        model): what a client of the MLX RL Inference Server shape expects after /load_adapter."""
        if name and not self.latest(name):
            raise AdapterError(f"adapter {name!r} is not loaded", status=404, code="adapter_not_found")
        self.default_name = name

    def unload(self, name: str) -> int:
        """Forget every version of `name` (running sequences finish under theirs); returns how many.
        Unloading the default policy makes the base model the default again."""
        got = self.versions.pop(name, None)
        if not got:
            raise AdapterError(f"adapter {name!r} is not loaded", status=404, code="adapter_not_found")
        if name == self.default_name:
            self.default_name = ""
        for a in got:
            self.router.forget(a.uid)
        return len(got)

    def _prepare(self, name: str, config: dict | None, weights: bytes | dict | None, path: str, fmt: Format,
                 version: int) -> LoadedAdapter:
        if not isinstance(name, str) or not NAME_RE.match(name) or ":" in name:
            raise AdapterError(f"adapter name {name!r} must be 1-128 characters of letters, digits, '_', '.', "
                               "'-' or '/', starting with a letter or digit")
        latest = self.latest(name)
        if version < 0:
            raise AdapterError(f"version must be positive (got {version})", code="invalid_version")
        if version == 0:
            version = latest.version + 1 if latest else 1
        elif latest is not None and version <= latest.version:
            raise AdapterError(f"adapter {name!r} is already at version {latest.version}; versions must increase "
                               f"(got {version})", status=409, code="version_conflict")
        if fmt not in ("auto", "mlx", "peft"):
            raise AdapterError(f"format must be auto, mlx or peft (got {fmt!r})")
        source = "inline"
        if path:
            if weights:
                raise AdapterError("give the weights inline or a path, not both")
            dir_config, weights, found = read_dir(path)
            config = {**dir_config, **(config or {})}
            fmt = found if fmt == "auto" else fmt
            source = str(Path(path))
        if not weights:
            raise AdapterError("no adapter weights: give safetensors bytes inline or a path")
        parsed = parse(config or {}, weights, fmt, dtype=self.dtype)
        if self.switches:  # a PEFT adapter names each expert's linear; mlx-lm's model holds them stacked
            try:
                parsed.modules = stack_experts(parsed.modules, self.switches)
            except ValueError as exc:
                raise AdapterError(f"adapter does not match the base model: {exc}") from None
        if self.sharded:
            parsed = self._local_part(parsed)
        modules, gains = self._bind(parsed)
        nbytes = sum(m.nbytes for m in modules.values()) + sum(g.nbytes for g in gains.values())
        return LoadedAdapter(name=name, version=version, kind=parsed.kind, format=parsed.format, rank=parsed.rank,
                             modules=modules, gains=gains, nbytes=nbytes, source=source, loaded_at=time.time(),
                             experts=any(m.experts for m in modules.values()))

    def _bind(self, parsed: ParsedAdapter) -> tuple[dict[str, PreparedLoRA], dict[str, mx.array]]:
        """Check every module against the base model; the weights in the layer's compute type."""
        num_layers = parsed.config.get("num_layers") if parsed.format == "mlx" else None
        linears = {}
        for path, m in parsed.modules.items():
            layer = _LAYER_RE.search(path)
            if layer and self.num_layers and int(layer.group(1)) >= self.num_layers:
                raise AdapterError(f"adapter does not match the base model: it targets layer {layer.group(1)} "
                                   f"({path}) but the base model has {self.num_layers} layers")
            if m.a.ndim == 3 or path in self.switches:
                linear = self._check_experts(path, m)
            else:
                linear = self._check_dense(path, m)
            if isinstance(num_layers, int) and 0 <= num_layers < self.num_layers and layer and \
                    int(layer.group(1)) < self.num_layers - num_layers:
                raise AdapterError(f"{path} is outside the last num_layers={num_layers} layers the config names")
            linears[path] = linear
        if not linears:
            raise AdapterError("the adapter targets no layer")
        dense = [linear for path, linear in linears.items() if path not in self.switches]
        merge = all(isinstance(linear, nn.Linear) for linear in dense) and \
            sum(linear.weight.nbytes for linear in dense) <= self.merge_bytes
        modules: dict[str, PreparedLoRA] = {}
        gains: dict[str, mx.array] = {}
        for path, m in parsed.modules.items():
            linear = linears[path]
            dtype = compute_dtype(linear)
            a, b = m.a.astype(dtype), m.b.astype(dtype)
            if path in self.switches:  # experts: never merged (that would copy every expert's weight)
                modules[path] = PreparedLoRA(a=a, b=b, scale=m.scale)
                continue
            mag = merged = None
            if m.m is not None:
                mag = m.m.astype(mx.float32)
                w = dense_weight(linear).astype(mx.float32)
                adapted = w + (m.scale * b.T.astype(mx.float32)) @ a.T.astype(mx.float32)
                gain = mag / mx.linalg.norm(adapted, axis=1)
                gains[path] = gain.astype(dtype)
                if merge:
                    merged = (gain[:, None] * adapted).astype(dtype)
            elif merge:
                merged = mx.addmm(linear.weight, b.T, a.T, alpha=m.scale)
            modules[path] = PreparedLoRA(a=a, b=b, scale=m.scale, m=mag, merged=merged)
        mx.eval([(x.a, x.b, x.merged) for x in modules.values()], list(gains.values()))
        bad = nonfinite_names(gains)
        if bad:
            raise AdapterError(f"DoRA gains of {bad[0]} are not finite (a zero-norm adapted weight?)")
        return modules, gains

    def _check_dense(self, path: str, m) -> nn.Module:
        """The Linear / QuantizedLinear an adapter's [in, r] / [r, out] update targets, checked."""
        linear = self.linears.get(path)
        if linear is None:
            if path in self.other_modules:
                raise AdapterError(f"module {path!r} is a {self.other_modules[path]}, not a linear layer; only "
                                   "Linear and QuantizedLinear layers (and mlx-lm's MoE expert layers) take adapters")
            example = next(iter(self.linears), "")
            raise AdapterError(f"adapter does not match the base model: it has no module {path!r} (its linear "
                               f"layers are named like {example!r})")
        in_dims, out_dims = linear_dims(linear)
        if m.a.shape[0] != in_dims or m.b.shape[1] != out_dims:
            raise AdapterError(f"adapter does not match the base model: {path} maps {m.a.shape[0]} -> "
                               f"{m.b.shape[1]} features in the adapter (lora_a {tuple(m.a.shape)}, lora_b "
                               f"{tuple(m.b.shape)}) but {in_dims} -> {out_dims} in the base model")
        return linear

    def _check_experts(self, path: str, m) -> nn.Module:
        """The expert projection an adapter's [E, in, r] / [E, r, out] update targets, checked."""
        linear = self.switches.get(path)
        if linear is None:
            # the class mlx defines (a fused projection's stand-in subclasses it: engine/fused_projections.py)
            mlx_class = next((c for c in type(self.linears[path]).__mro__ if c.__module__.startswith("mlx.")),
                             type(self.linears[path])) if path in self.linears else None
            why = self.other_modules.get(path) or (f"a {mlx_class.__name__}" if mlx_class is not None
                                                   else "not a module of the base model")
            raise AdapterError(f"adapter does not match the base model: {path} holds an expert layer's update "
                               f"(lora_a {tuple(m.a.shape)}) but is {why}")
        experts, in_dims, out_dims = switch_dims(linear)
        if m.a.ndim != 3:
            raise AdapterError(f"adapter does not match the base model: {path} is an expert layer ({experts} experts) "
                               f"but its update has lora_a {tuple(m.a.shape)}, not [experts, r, in]")
        if m.a.shape[0] != experts or m.a.shape[1] != in_dims or m.b.shape[2] != out_dims:
            raise AdapterError(f"adapter does not match the base model: {path} has {m.a.shape[0]} experts mapping "
                               f"{m.a.shape[1]} -> {m.b.shape[2]} features in the adapter but {experts} experts "
                               f"mapping {in_dims} -> {out_dims} in the base model")
        return linear

    def _local_part(self, parsed: ParsedAdapter) -> ParsedAdapter:
        """On a tensor-parallel engine: this rank's slice of each update of a sharded layer (sharded.py),
        checked against the whole layer first; the local views re-made (a full-weight update may have
        replaced the arrays they share)."""
        for p, layer in self.sharded.items():
            self.linears[p] = local_linear(layer)
        modules = {p: shard_lora(p, m, self.sharded[p]) if p in self.sharded else m for p, m in parsed.modules.items()}
        return dataclasses.replace(parsed, modules=modules)

    def _commit(self, adapter: LoadedAdapter) -> None:
        blocks = {p.rsplit(".", 1)[0] for p in adapter.modules if p in self.switches} - self.switch_blocks
        if blocks:
            by_path = dict(self.model.named_modules())
            for block_path in sorted(blocks):
                enable(by_path[block_path], block_path, self.router)
            self.switch_blocks.update(blocks)
        new = [p for p in adapter.modules if p not in self.wrapped and p not in self.switches]
        if new:
            self.model.update_modules(tree_unflatten(
                [(p, MultiLoRALinear(self.sharded.get(p, self.linears[p]), p, self.router)) for p in new]))
            self.wrapped.update(new)
        kept = self.versions.setdefault(adapter.name, [])
        kept.append(adapter)
        while len(kept) > self.history:
            old = kept.pop(0)
            self.router.forget(old.uid)
        self.published += 1
