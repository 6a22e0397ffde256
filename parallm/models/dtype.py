"""The weight dtype policy, applied to a loaded mlx-lm model.

- unset (None): float32 on MLX's CPU device; elsewhere the model's own type ("quantized" if it has
  quantized layers, else the float type holding most of its parameters), except that on a CUDA GPU
  a quantized dense model whose bfloat16 weights fit CUDA_DEQUANTIZE_FRACTION of the device's memory
  is served in bfloat16 (see default_dtype). On CPU, float32 runs through the BLAS (OpenBLAS when
  preloaded) while quantized matmuls run in MLX's own kernels: measured on a 2-core x86 machine with
  SmolLM2-135M, float32 + OpenBLAS decoded a 16-row batch about 9x faster than the Q4_1/Q8_0 weights.
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

from parallm import device

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


# On a CUDA GPU, quantized dense checkpoints whose bfloat16 weights take at most this share of the
# device's memory are served dequantized: MLX's CUDA quantized matmul does not scale with rows (on an
# H200 a 64-row decode step of a Qwen3-8B-shaped 4-bit model cost 24x a one-row step; issue 37).
# MoE experts (QuantizedSwitchLinear) stay quantized: not measured.
CUDA_DEQUANTIZE_FRACTION = 0.5


def dequantized_bytes(model: nn.Module, itemsize: int = 2) -> int:
    """The model's weight bytes once every quantized layer is a plain float layer of `itemsize` bytes."""
    quantized = dict(_quantized_modules(model))
    total = 0
    for name, value in tree_flatten(model.parameters()):
        owner, _, leaf = name.rpartition(".")
        module = quantized.get(owner)
        if module is None or leaf not in ("weight", "scales", "biases"):
            total += value.size * itemsize
        elif leaf == "weight":  # packed: 32 / bits values in each uint32
            total += value.size * 32 // module.bits * itemsize
    return total


def default_dtype(model: nn.Module, *, on_cpu: bool | None = None, cuda_memory: int | None = None) -> str:
    """The dtype an unset `model.dtype` resolves to on this device; `on_cpu` and `cuda_memory` (the CUDA
    device's bytes, None for none) stand in for the device query when given."""
    if on_cpu if on_cpu is not None else mx.default_device() == mx.cpu:
        return "float32"
    stored = stored_dtype(model)
    quantized = _quantized_modules(model)
    if stored != "quantized" or any(isinstance(m, QuantizedSwitchLinear) for _, m in quantized):
        return stored
    total = cuda_memory if on_cpu is not None else (device.cuda_memory() or (None, None))[1]
    if total is not None and dequantized_bytes(model, 2) <= CUDA_DEQUANTIZE_FRACTION * total:
        return "bfloat16"
    return stored


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
    target = requested if requested is not None else default_dtype(model)
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
