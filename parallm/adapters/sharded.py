"""LoRA on a tensor-parallel engine: an adapter's A and B sliced the way mlx-lm sliced the base layer.

`model.shard(group)` (parallm/engine/distributed.py) replaces a model's linear layers by two kinds of
layer from mlx.nn.layers.distributed:
- all-to-sharded (q/k/v, gate/up projections): rank r holds the rows W[out_r] (and the bias's
  slice) and computes its slice of the output features from the whole input;
- sharded-to-all (o, down): rank r holds the columns W[:, in_r], computes x_r @ W_r^T on its slice
  of the input features, and the ranks all-sum the partial outputs (then add the bias).

A LoRA update, delta = scale * (x @ A) @ B with A [in, r] and B [r, out], splits along the same
dimensions, exactly:
- all-to-sharded: A whole on every rank (the input is whole), B's columns out_r: rank r computes
  its own output slice of the delta. DoRA's magnitude is sliced alike (its norm is per output row).
- sharded-to-all: A's rows in_r, B whole. Each rank adds scale * (x_r @ A_r) @ B to its partial
  output before the all-sum; the sum over ranks of x_r @ A_r is x @ A, so the all-sum carries the
  whole delta once (`ShardedBase.finish`). DoRA is refused there: its norm runs over all the
  input features of a row, which no rank holds.
Fused layers (several projections in one matrix: mlx-lm's `segments`) are sliced segment by
segment, as mlx-lm slices their weights; `recording_segments` notes each layer's segments while the
model is sharded. The adapter is checked against the whole layer's dimensions first, so a
mismatch names the dimensions the client knows. Full-weight updates are sliced by the same rules
(`shard_tensor`, used by parallm/engine/weights.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from .errors import AdapterError
from .formats import ModuleLoRA

ALL_TO_SHARDED = (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)
SHARDED_TO_ALL = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)
SHARDED = ALL_TO_SHARDED + SHARDED_TO_ALL


@dataclass(frozen=True)
class Segments:
    """The segments mlx-lm sharded a layer with (1, a count, or split points)."""

    value: int | tuple = 1


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, SHARDED)


def _quantized(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear))


def _segments(layer: nn.Module) -> int | list:
    seg = getattr(layer, "parallm_segments", None)
    value = seg.value if seg is not None else 1
    return list(value) if isinstance(value, tuple) else value


def split(x: mx.array, axis: int, segments: int | list, size: int, rank: int) -> mx.array:
    """Rank `rank`'s part of `x` along `axis`, as mlx.nn.layers.distributed slices a weight: each
    segment split `size` ways, the rank's pieces concatenated."""
    if isinstance(segments, int) or isinstance(segments[0], int):
        parts = mx.split(x, segments, axis=axis)
    else:  # fractions of the axis
        parts = mx.split(x, [int(s * x.shape[axis]) for s in segments], axis=axis)
    return mx.contiguous(mx.concatenate([mx.split(p, size, axis=axis)[rank] for p in parts], axis=axis))


def full_dims(layer: nn.Module) -> tuple[int, int]:
    """(input features, output features) of the whole layer that `layer` is this rank's slice of."""
    out_dims, in_dims = layer.weight.shape
    if _quantized(layer):
        in_dims = in_dims * 32 // layer.bits
    n = layer.group.size()
    return (in_dims * n, out_dims) if isinstance(layer, SHARDED_TO_ALL) else (in_dims, out_dims * n)


def shard_lora(path: str, m: ModuleLoRA, layer: nn.Module) -> ModuleLoRA:
    """This rank's part of the update `m` of sharded layer `layer` (module docstring)."""
    in_dims, out_dims = full_dims(layer)
    if m.a.shape[0] != in_dims or m.b.shape[1] != out_dims:
        raise AdapterError(f"adapter does not match the base model: {path} maps {m.a.shape[0]} -> {m.b.shape[1]} "
                           f"features in the adapter (lora_a {tuple(m.a.shape)}, lora_b {tuple(m.b.shape)}) but "
                           f"{in_dims} -> {out_dims} in the base model")
    n, rank, seg = layer.group.size(), layer.group.rank(), _segments(layer)
    if isinstance(layer, ALL_TO_SHARDED):
        mag = split(m.m, 0, seg, n, rank) if m.m is not None else None
        return ModuleLoRA(a=m.a, b=split(m.b, 1, seg, n, rank), scale=m.scale, m=mag)
    if m.m is not None:
        raise AdapterError(f"DoRA on {path} is not supported on a tensor-parallel engine: that layer's input "
                           "features are split over the ranks, and DoRA's norm needs them all (LoRA works there, "
                           "DoRA works on the q/k/v and gate/up projections)", code="unsupported_adapter")
    return ModuleLoRA(a=split(m.a, 0, seg, n, rank), b=m.b, scale=m.scale)


def shard_tensor(layer: nn.Module, leaf: str, value: mx.array) -> mx.array:
    """This rank's part of a whole-model tensor `leaf` (weight, bias, scales, biases) of sharded
    `layer`, as mlx-lm's shard slices it; ValueError when `value` is not the whole tensor's shape."""
    local = layer[leaf]
    n, rank, seg = layer.group.size(), layer.group.rank(), _segments(layer)
    if isinstance(layer, SHARDED_TO_ALL):
        axis = None if leaf == "bias" else local.ndim - 1
    else:
        axis = local.ndim - 1 if leaf == "bias" else max(local.ndim - 2, 0)
    whole = tuple(d * n if i == axis else d for i, d in enumerate(local.shape))
    if tuple(value.shape) != whole:
        raise ValueError(f"has shape {tuple(value.shape)}; the model's (before tensor-parallel sharding) is {whole}")
    return value if axis is None else split(value, axis, seg, n, rank)


def local_linear(layer: nn.Module) -> nn.Module:
    """A plain Linear / QuantizedLinear sharing `layer`'s arrays: what this rank computes before any
    all-sum (a sharded-to-all layer's bias is added after the all-sum, so it is left out)."""
    quantized = _quantized(layer)
    view = nn.QuantizedLinear.__new__(nn.QuantizedLinear) if quantized else nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(view)
    view.weight = layer.weight
    if quantized:
        view.scales = layer.scales
        if "biases" in layer:
            view.biases = layer.biases
        view.group_size, view.bits, view.mode = layer.group_size, layer.bits, getattr(layer, "mode", "affine")
    if "bias" in layer and isinstance(layer, ALL_TO_SHARDED):
        view.bias = layer.bias
    view.freeze()
    return view


class ShardedBase:
    """How an adapted sharded layer runs a pass on this rank: the adapter plan on `local()`, then
    `finish` (for sharded-to-all: the all-sum of the partial outputs, then the bias)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.reduce = isinstance(layer, SHARDED_TO_ALL)
        self._view: nn.Module | None = None

    def local(self) -> nn.Module:
        if self._view is None or self._view.weight is not self.layer.weight:  # a full-weight update replaced it
            self._view = local_linear(self.layer)
        return self._view

    def finish(self, y: mx.array) -> mx.array:
        if not self.reduce:
            return y
        y = mx.distributed.all_sum(y, group=self.layer.group)
        return y + self.layer.bias if "bias" in self.layer else y


@contextlib.contextmanager
def recording_segments() -> Iterator[None]:
    """While mlx-lm shards a model, note on each sharded layer the segments it was sliced with
    (mlx's sharded layers do not keep them, and a fused layer's adapter must be sliced alike)."""
    patched = []
    for cls in SHARDED:
        name = "from_quantized_linear" if cls in (nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear) \
            else "from_linear"
        original = cls.__dict__[name]

        def recorded(klass, linear, *, segments=1, group=None, _original=original):
            layer = _original.__func__(klass, linear, segments=segments, group=group)
            layer.parallm_segments = Segments(tuple(segments) if isinstance(segments, list) else segments)
            return layer

        setattr(cls, name, classmethod(recorded))
        patched.append((cls, name, original))
    try:
        yield
    finally:
        for cls, name, original in patched:
            setattr(cls, name, original)
