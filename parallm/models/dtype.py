"""The weight dtype policy, applied to a loaded mlx-lm model (docs/models.md, "the dtype policy").

`choose_dtype` decides what the weights are served as, and why; `apply_dtype` brings them there.
Two settings decide it: `model.dtype` (a float type, or "quantized") and `model.quantized_weights`
(keep / dequantize, for a quantized checkpoint). Left unset, per backend:
- MLX's CPU device: float32. float32 matmuls run through the BLAS (OpenBLAS when preloaded) while
  quantized matmuls run in MLX's own kernels: measured on a 2-core x86 machine with SmolLM2-135M,
  float32 + OpenBLAS decoded a 16-row batch about 9x faster than the Q4_1/Q8_0 weights.
- a CUDA GPU: a quantized dense checkpoint is served dequantized to bfloat16 when its bfloat16 weights
  and the KV budget fit the device (see cuda_fits); else it stays quantized. MLX's CUDA quantized
  matmul does not scale with rows: on an H200 a 64-row decode step of a Qwen3-8B-shaped 4-bit model
  cost 24x a one-row step (issue 37; docs/performance.md). MoE experts stay quantized (not measured).
- Metal: as stored (MLX's Metal quantized matmul is fast; a quantized model stays quantized).
Conversions:
- "float32" / "float16" / "bfloat16": quantized layers are dequantized with mx.dequantize (through
  float32) into plain nn.Linear / nn.Embedding / SwitchLinear, and every floating parameter is cast.
- "quantized": quantized layers are kept; the other floating parameters (norms, biases, layers
  stored unquantized) are cast to the quantization scales' type, so the model computes in one
  type instead of promoting every activation to float32 at the first float32 norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from parallm import device

from .errors import ModelLoadError

FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPES = (*FLOAT_DTYPES, "quantized")
QUANTIZED_WEIGHTS = ("keep", "dequantize")  # model.quantized_weights; unset = auto (the backend's policy)
_NAMES = {v: k for k, v in FLOAT_DTYPES.items()}
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """What the checkpoint's weights are (`stored`), what they are served as (`served`), and why
    (logged at load, and in the engine's stats as `weight_dtype`)."""

    stored: str
    served: str
    reason: str


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


# On a CUDA GPU with model.quantized_weights unset, a quantized dense checkpoint is served dequantized
# when its bfloat16 weights plus the KV budget take at most CUDA_USABLE_SHARE of the device's memory
# (the rest: activations, logits, MLX's buffer cache). The KV budget is engine.kv_budget_mb when set,
# else CUDA_KV_RESERVE_SHARE of the device: so the weights take at most half of it, and the unset KV
# budget (half the memory free after the weights, engine/memory.py) gets at least a quarter of it.
CUDA_USABLE_SHARE = 0.9
CUDA_KV_RESERVE_SHARE = 0.4


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


def cuda_fits(weight_bytes: int, total_bytes: int, kv_budget_bytes: int | None = None) -> tuple[bool, int]:
    """Whether `weight_bytes` of weights and the KV budget (`kv_budget_bytes`, None: the reserve for an
    unset one) fit a CUDA device of `total_bytes`; (fits, the KV bytes counted)."""
    kv = kv_budget_bytes if kv_budget_bytes is not None else int(CUDA_KV_RESERVE_SHARE * total_bytes)
    return weight_bytes + kv <= CUDA_USABLE_SHARE * total_bytes, kv


def _check_settings(dtype: str | None, quantized_weights: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)} (or leave it unset)")
    if quantized_weights is not None and quantized_weights not in QUANTIZED_WEIGHTS:
        raise ModelLoadError(f"unknown quantized_weights '{quantized_weights}'; choose one of "
                             f"{', '.join(QUANTIZED_WEIGHTS)} (or leave it unset: auto)")
    if (dtype == "quantized" and quantized_weights == "dequantize") or \
            (dtype in FLOAT_DTYPES and quantized_weights == "keep"):
        raise ModelLoadError(f"model.dtype {dtype} contradicts model.quantized_weights {quantized_weights}; "
                             "set one of them")


def choose_dtype(model: nn.Module, dtype: str | None = None, quantized_weights: str | None = None, *,
                 kv_budget_bytes: int | None = None) -> DtypeChoice:
    """What `model`'s weights are served as on this backend (parallm.device's queries, which tests
    stub), given `model.dtype` and `model.quantized_weights` (None: unset) and the configured KV budget
    (`kv_budget_bytes`, None: unset), with the reason."""
    _check_settings(dtype, quantized_weights)
    stored = stored_dtype(model)
    backend = device.compute_device()
    if dtype is not None:
        return DtypeChoice(stored, dtype, f"model.dtype {dtype} (configured)")
    if backend == "cpu":
        if stored == "quantized" and quantized_weights is not None:
            served = "quantized" if quantized_weights == "keep" else "float32"
            return DtypeChoice(stored, served, f"model.quantized_weights {quantized_weights} (configured)")
        return DtypeChoice(stored, "float32", "MLX's CPU device: float32 matmuls run through the BLAS, "
                                              "quantized ones in MLX's slower kernels (docs/models.md)")
    if stored != "quantized":
        return DtypeChoice(stored, stored, "not quantized: served as stored")
    if quantized_weights == "keep":
        return DtypeChoice(stored, "quantized", "model.quantized_weights keep (configured)")
    if quantized_weights == "dequantize":
        return DtypeChoice(stored, "bfloat16", "model.quantized_weights dequantize (configured)")
    if backend != "cuda":
        return DtypeChoice(stored, "quantized", f"{backend}: MLX's quantized matmul is fast here, kept as stored")
    if any(isinstance(m, QuantizedSwitchLinear) for _, m in _quantized_modules(model)):
        return DtypeChoice(stored, "quantized", "cuda: MoE experts stay quantized (dequantized experts not measured)")
    memory = device.cuda_memory()
    if memory is None:
        return DtypeChoice(stored, "quantized", "cuda: the device's memory is unknown, kept as stored")
    need = dequantized_bytes(model, 2)
    fits, kv = cuda_fits(need, memory[1], kv_budget_bytes)
    sizes = (f"bfloat16 weights {need / GIB:.1f} GiB + KV {kv / GIB:.1f} GiB {'within' if fits else 'over'} "
             f"{CUDA_USABLE_SHARE:.0%} of the device's {memory[1] / GIB:.1f} GiB")
    if fits:
        return DtypeChoice(stored, "bfloat16", "cuda: MLX's quantized matmul does not scale with rows "
                                               f"(docs/performance.md), dequantized: {sizes}")
    return DtypeChoice(stored, "quantized", f"cuda: kept quantized, {sizes}")


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
    """Bring `model`'s weights to `requested` in place (None: choose_dtype's unset policy); returns
    what they are now."""
    _check_settings(requested, None)
    target = requested if requested is not None else choose_dtype(model).served
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
