"""The weight dtype policy, applied to a loaded mlx-lm model.

- unset (None): float32 on MLX's CPU device; elsewhere the model's own type ("quantized" if it has
  quantized layers, else the float type holding most of its parameters). On CPU, float32 runs
  through the BLAS (OpenBLAS when preloaded) while quantized matmuls run in MLX's own kernels:
  measured on a 2-core x86 machine with SmolLM2-135M, float32 + OpenBLAS decoded a 16-row batch
  about 9x faster than the Q4_1/Q8_0 weights.
- "float32" / "float16" / "bfloat16": quantized layers are dequantized (through float32) into
  plain nn.Linear / nn.Embedding, and every floating parameter is cast to that type.
- "quantized": quantized layers are kept; the other floating parameters (norms, biases, layers
  stored unquantized) are cast to the quantization scales' type, so the model computes in one
  type instead of promoting every activation to float32 at the first float32 norm.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .errors import ModelLoadError

FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPES = (*FLOAT_DTYPES, "quantized")
_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}


def _quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            found.append((name, module))
        elif "scales" in module:
            raise ModelLoadError(f"module {name} is quantized as {type(module).__name__}, which parallm's "
                                 "dtype policy cannot handle (only QuantizedLinear, QuantizedEmbedding and "
                                 "mlx-lm's QuantizedSwitchLinear)")
    return found


def _float_params(model: nn.Module) -> list[tuple[str, mx.array]]:
    return [(k, v) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]


def stored_dtype(model: nn.Module) -> str:
    """What the weights are: "quantized" if any layer is, else the float type of most parameters."""
    if _quantized_modules(model):
        return "quantized"
    sizes: dict[mx.Dtype, int] = {}
    for _, v in _float_params(model):
        sizes[v.dtype] = sizes.get(v.dtype, 0) + v.size
    if not sizes:
        raise ModelLoadError("model has no floating-point parameters")
    dominant = max(sizes, key=sizes.__getitem__)
    if dominant not in _NAMES:
        raise ModelLoadError(f"model weights are {dominant}, which is not float32, float16 or bfloat16")
    return _NAMES[dominant]


def _dequantize(module: nn.Module, dtype: mx.Dtype) -> nn.Module:
    f32 = mx.float32
    scales = module.scales.astype(f32) if mx.issubdtype(module.scales.dtype, mx.floating) else module.scales
    biases = getattr(module, "biases", None)
    kwargs = {"global_scale": module.global_scale} if "global_scale" in module else {}
    weight = mx.dequantize(module.weight, scales, None if biases is None else biases.astype(f32),
                           module.group_size, module.bits, module.mode, dtype=f32, **kwargs).astype(dtype)
    if isinstance(module, nn.QuantizedEmbedding):
        plain = nn.Embedding(*weight.shape)
    elif isinstance(module, QuantizedSwitchLinear):  # weight: [experts, out, in]
        experts, out_dims, in_dims = weight.shape
        plain = SwitchLinear(in_dims, out_dims, experts, bias="bias" in module)
        if "bias" in module:
            plain.bias = module.bias.astype(dtype)
    else:
        plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
        if "bias" in module:
            plain.bias = module.bias.astype(dtype)
    plain.weight = weight
    return plain


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    changed = [(k, v.astype(dtype)) for k, v in _float_params(model) if v.dtype != dtype]
    if changed:
        model.update(tree_unflatten(changed), strict=False)


def apply_dtype(model: nn.Module, requested: str | None) -> str:
    """Bring `model`'s weights to the policy's type in place (None: the device's default); returns
    what they are now."""
    if requested is not None and requested not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{requested}'; choose one of {', '.join(DTYPES)} (or leave it unset)")
    target = requested
    if requested is None:
        target = "float32" if mx.default_device() == mx.cpu else stored_dtype(model)
    quantized = _quantized_modules(model)
    if target in FLOAT_DTYPES:
        dtype = FLOAT_DTYPES[target]
        if quantized:
            model.update_modules(tree_unflatten([(name, _dequantize(m, dtype)) for name, m in quantized]))
        _cast(model, dtype)
        return target
    if not quantized:
        raise ModelLoadError(f"dtype 'quantized' keeps the stored quantization, but this model's weights are "
                             f"{stored_dtype(model)}; leave dtype unset or choose a float dtype (or quantize it with mlx_lm.convert -q)")
    scales = quantized[0][1].scales
    _cast(model, scales.dtype if mx.issubdtype(scales.dtype, mx.floating) else mx.float16)
    return "quantized"
