"""Full-weight policy updates: new base-model weights swapped into the running model, one layer at a time.

A trainer that updates every weight (not a LoRA adapter) hands the engine a directory of safetensors
files (prime-rl's `/update_weights {weight_dir}`, SGLang's `/update_weights_from_disk {model_path}`)
or streams chunks of safetensors bytes over its PUB socket. Either way the tensors are read and
applied layer by layer: a layer's new arrays are materialised, assigned into the model and
evaluated before the next layer is read, so at most one extra copy of a layer exists at a time
(the replaced arrays are freed once nothing references them; a pass already launched keeps the old
ones until it is read, since MLX arrays are immutable).

Every tensor is checked first (a known parameter name, the parameter's shape, finite values): a
directory is checked whole before anything is applied (it is read twice, lazily), so a bad file
changes nothing. Names are the model's own (mlx-lm) or Hugging Face's, mapped by the model's
`sanitize` when it has one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from parallm.adapters.sharded import is_sharded, shard_tensor

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class WeightsError(Exception):
    """A weight update that cannot be applied; `status`/`code` as the HTTP answer would give them."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_weights") -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


@dataclass
class Applied:
    tensors: int
    layers: int
    load_ms: float


def layer_of(name: str) -> int:
    """The transformer layer a tensor belongs to (-1: embeddings, norms, the head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def by_layer(tensors: Mapping[str, mx.array]) -> list[dict[str, mx.array]]:
    groups: dict[int, dict[str, mx.array]] = {}
    for name, value in tensors.items():
        groups.setdefault(layer_of(name), {})[name] = value
    return [groups[k] for k in sorted(groups)]


def safetensors_files(path: str | Path) -> list[Path]:
    root = Path(path)
    if not root.is_dir():
        raise WeightsError(f"weight directory {str(root)!r} does not exist or is not a directory", status=404,
                           code="weights_not_found")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors file in {str(root)!r}", status=404, code="weights_not_found")
    return files


class WeightSwapper:
    """Checks and applies new values of a model's parameters (quantized models: only tensors whose
    stored shape and dtype kind match, e.g. the non-quantized norms, or a checkpoint quantized alike)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def _params(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.parameters()))

    def sanitize(self, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hugging Face names to the model's (mlx-lm's model.sanitize), when the model has one."""
        fix = getattr(self.model, "sanitize", None)
        if fix is None:
            return tensors
        try:
            return fix(dict(tensors))
        except Exception:  # noqa: BLE001 - a sanitize that does not fit a partial update: names as given
            return tensors

    def named(self, tensors: Mapping[str, mx.array], params: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Tensors under the running model's parameter names: a linear layer an adapter router wraps
        (parallm.adapters.lora.MultiLoRALinear) holds its weights one level down, in `.linear`. On a
        tensor-parallel rank, a sharded layer's whole tensor becomes this rank's slice of it."""
        sharded = {p: m for p, m in self.model.named_modules() if is_sharded(m)}
        out = {}
        for name, value in tensors.items():
            if name not in params:
                head, _, leaf = name.rpartition(".")
                wrapped = f"{head}.linear.{leaf}"
                if wrapped in params:
                    name = wrapped
            head, _, leaf = name.rpartition(".")
            if head in sharded and name in params:
                try:
                    value = shard_tensor(sharded[head], leaf, value)
                except ValueError as exc:
                    raise WeightsError(f"tensor {name!r} {exc}", code="shape_mismatch") from None
            out[name] = value
        return out

    def check(self, tensors: Mapping[str, mx.array], params: Mapping[str, mx.array] | None = None) -> None:
        """WeightsError naming the first tensor that is unknown, misshapen or not finite (changes nothing)."""
        params = self._params() if params is None else params
        for name, value in tensors.items():
            old = params.get(name)
            if old is None:
                raise WeightsError(f"tensor {name!r} is not a parameter of the served model", code="unknown_tensor")
            if tuple(value.shape) != tuple(old.shape):
                raise WeightsError(f"tensor {name!r} has shape {tuple(value.shape)}; the model's is {tuple(old.shape)}",
                                   code="shape_mismatch")
            if mx.issubdtype(old.dtype, mx.floating) != mx.issubdtype(value.dtype, mx.floating):
                raise WeightsError(f"tensor {name!r} is {value.dtype}; the model's is {old.dtype}", code="dtype_mismatch")
            if mx.issubdtype(value.dtype, mx.floating) and not bool(mx.all(mx.isfinite(value)).item()):
                raise WeightsError(f"tensor {name!r} holds NaN or infinite values", code="non_finite")

    def apply(self, tensors: Mapping[str, mx.array]) -> Applied:
        """Check, then assign layer by layer (each evaluated before the next is read)."""
        t0 = time.perf_counter()
        params = self._params()
        groups = by_layer(self.named(self.sanitize(dict(tensors)), params))
        for group in groups:
            self.check(group, params)
        for group in groups:
            self._assign(group, params)
        return Applied(len(tensors), len(groups), 1000 * (time.perf_counter() - t0))

    def apply_dir(self, path: str | Path) -> Applied:
        """A directory of safetensors: every file checked layer by layer first, then applied layer by layer."""
        t0 = time.perf_counter()
        files = safetensors_files(path)
        params = self._params()
        count = layers = 0
        for apply in (False, True):
            for group in self._dir_groups(files, params):
                if apply:
                    self._assign(group, params)
                    count, layers = count + len(group), layers + 1
                else:
                    self.check(group, params)
        return Applied(count, layers, 1000 * (time.perf_counter() - t0))

    def _dir_groups(self, files: list[Path], params: Mapping[str, mx.array]) -> Iterator[dict[str, mx.array]]:
        """Every tensor of the directory, one layer's worth at a time (MLX loads lazily: a tensor is
        read from disk when it is evaluated)."""
        lazy: dict[str, mx.array] = {}
        for f in files:
            try:
                lazy.update(mx.load(str(f)))
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the client's error
                raise WeightsError(f"cannot read {f.name}: {exc}", code="invalid_weights") from None
        yield from by_layer(self.named(self.sanitize(lazy), params))

    def _assign(self, group: Mapping[str, mx.array], params: dict[str, mx.array]) -> None:
        values = [(name, value.astype(params[name].dtype)) for name, value in group.items()]
        self.model.load_weights(values, strict=False)
        mx.eval([v for _, v in values])
        for name, value in values:
            params[name] = value
