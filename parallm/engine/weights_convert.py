"""A full-weight update in the precision the server serves: quantized tensors for a dequantized served
layer are dequantized, float tensors for a quantized served layer are quantized as that layer is.

The engine may serve a model in another precision than its checkpoint's (the dtype policy,
parallm.models.dtype: on MLX's CPU device a 4-bit checkpoint is served in float32). An update read
from that checkpoint's own directory (or any quantized one) names `X.weight` (packed), `X.scales` and
`X.biases` where the served layer has only a float `X.weight`; a trainer that updates a float copy
sends float `X.weight` where the served layer is quantized. Both are brought to the served layer's
form here, layer by layer, before the update is checked; what cannot be converted is refused up
front with the reason (WeightsError), so nothing is applied.

A checkpoint's quantization is read from its shapes: bits = 32 x packed columns / the served layer's
input width, group size = input width / scale columns; affine (scales and biases), or MLX's
microscaling modes (uint8 scales, no biases: mxfp4 = 4 bits in groups of 32, nvfp4 = 4 in 16,
mxfp8 = 8 in 32).
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from .weights_errors import WeightsError

QUANT_LEAVES = ("scales", "biases")
_MICROSCALING = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}


def _served_module(modules: Mapping[str, nn.Module], owner: str) -> tuple[str, nn.Module | None]:
    """The served module holding `owner`'s weights (one level down when an adapter router wraps it)."""
    module = modules.get(owner)
    if module is not None and "weight" not in module and "linear" in module:
        return f"{owner}.linear", module["linear"]
    return owner, module


def _quantized(module: nn.Module | None) -> bool:
    return module is not None and "scales" in module


def _source_quantization(owner: str, weight: mx.array, scales: mx.array, biases: mx.array | None,
                         in_dims: int) -> tuple[int, int, str]:
    """(bits, group size, mode) of a quantized tensor for a layer `in_dims` wide, from the shapes."""
    packed, groups = weight.shape[-1], scales.shape[-1]
    bits, rem = divmod(packed * 32, in_dims)
    if rem or bits not in (2, 3, 4, 5, 6, 8) or groups < 1 or in_dims % groups:
        raise WeightsError(f"tensor {owner!r}.weight is packed as {packed} uint32 columns with {groups} scale "
                           f"columns, which is no quantization of the served layer's {in_dims} inputs",
                           code="shape_mismatch")
    group_size = in_dims // groups
    if biases is not None:
        return bits, group_size, "affine"
    mode = _MICROSCALING.get((bits, group_size))
    if mode is None or scales.dtype != mx.uint8:
        raise WeightsError(f"tensor {owner!r} is quantized without biases at {bits} bits in groups of {group_size}, "
                           "which matches none of MLX's modes (affine needs biases; mxfp4, nvfp4, mxfp8 uint8 "
                           "scales)", code="dtype_mismatch")
    return bits, group_size, mode


def _dequantized(owner: str, tensors: Mapping[str, mx.array], in_dims: int) -> mx.array:
    weight, scales = tensors[f"{owner}.weight"], tensors[f"{owner}.scales"]
    biases = tensors.get(f"{owner}.biases")
    bits, group_size, mode = _source_quantization(owner, weight, scales, biases, in_dims)
    f32 = mx.float32
    return mx.dequantize(weight, scales.astype(f32) if mode == "affine" else scales,
                         None if biases is None else biases.astype(f32), group_size=group_size, bits=bits,
                         mode=mode, dtype=f32)


def _quantize_as(module: nn.Module, value: mx.array) -> dict[str, mx.array]:
    """weight/scales(/biases) of `value` quantized as the served `module` is, in its stored dtypes."""
    mode = getattr(module, "mode", "affine")
    parts = mx.quantize(value.astype(mx.float32), group_size=module.group_size, bits=module.bits, mode=mode)
    out = {"weight": parts[0], "scales": parts[1].astype(module["scales"].dtype)}
    if "biases" in module and module["biases"] is not None and len(parts) > 2:
        out["biases"] = parts[2].astype(module["biases"].dtype)
    return out


def to_served(tensors: Mapping[str, mx.array], modules: Mapping[str, nn.Module]) -> dict[str, mx.array]:
    """`tensors` (an update, mlx-lm names) with every layer in the served layer's form (see the module
    docstring); tensors of layers that already match, or that name no served module, pass unchanged."""
    out = dict(tensors)
    owners = {name.rpartition(".")[0] for name in tensors if name.endswith((".weight", ".scales"))}
    for owner in sorted(owners):
        path, module = _served_module(modules, owner)
        if module is None or "weight" not in module:
            continue
        source_quantized = f"{owner}.scales" in tensors
        if source_quantized and f"{owner}.weight" not in tensors:
            raise WeightsError(f"tensor {owner + '.scales'!r} comes without its {owner + '.weight'!r}",
                               code="unknown_tensor")
        weight = tensors.get(f"{owner}.weight")
        if weight is None:
            continue
        served_quantized = _quantized(module)
        if not source_quantized and not served_quantized:
            continue
        if source_quantized and served_quantized and all(
                f"{owner}.{leaf}" not in tensors or tensors[f"{owner}.{leaf}"].shape == module[leaf].shape
                for leaf in ("weight", "scales", "biases") if leaf in module):
            continue   # quantized alike: as it is
        in_dims = module.weight.shape[-1] * 32 // module.bits if served_quantized else module.weight.shape[-1]
        if source_quantized:
            value = _dequantized(owner, tensors, in_dims)
            for leaf in QUANT_LEAVES:
                out.pop(f"{owner}.{leaf}", None)
        elif not mx.issubdtype(weight.dtype, mx.floating):
            raise WeightsError(f"tensor {owner + '.weight'!r} is {weight.dtype} without scales; the served layer "
                               f"{path!r} is quantized", code="dtype_mismatch")
        else:
            value = weight
        if served_quantized:
            if value.shape[-1] != in_dims or value.shape[-1] % module.group_size:
                raise WeightsError(f"tensor {owner + '.weight'!r} has shape {tuple(value.shape)}; the served "
                                   f"layer {path!r} takes {in_dims} inputs (quantized in groups of "
                                   f"{module.group_size})", code="shape_mismatch")
            for leaf, part in _quantize_as(module, value).items():
                out[f"{owner}.{leaf}"] = part
        else:
            out[f"{owner}.weight"] = value
    return out
