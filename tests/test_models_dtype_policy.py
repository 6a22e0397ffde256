"""The unset dtype per device (parallm/models/dtype.py), with the device query passed in: float32 on
the CPU; on a CUDA GPU a quantized dense model is served in bfloat16 when that fits the device's
budget, a quantized MoE keeps its quantized experts, and a float model keeps its type."""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from parallm.models import tiny
from parallm.models.dtype import CUDA_DEQUANTIZE_FRACTION, default_dtype, dequantized_bytes
from tests.test_models_gpu_regressions import quantized_moe

GIB = 1 << 30


def dense(quantize: bool = True) -> nn.Module:
    model, _ = tiny.build("llama")
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_dequantized_bytes_counts_every_packed_value_once_and_drops_scales():
    plain = dense(quantize=False)
    want = sum(v.size for _, v in tree_flatten(plain.parameters())) * 2
    assert dequantized_bytes(plain, 2) == want
    quantized = dense()
    assert dequantized_bytes(quantized, 2) == want


def test_the_cpu_always_gets_float32():
    assert default_dtype(dense(), on_cpu=True, cuda_memory=80 * GIB) == "float32"


def test_cuda_serves_a_quantized_dense_model_in_bfloat16_when_it_fits():
    model = dense()
    need = dequantized_bytes(model, 2)
    assert default_dtype(model, on_cpu=False, cuda_memory=80 * GIB) == "bfloat16"
    fits = int(need / CUDA_DEQUANTIZE_FRACTION)
    assert default_dtype(model, on_cpu=False, cuda_memory=fits) == "bfloat16"
    assert default_dtype(model, on_cpu=False, cuda_memory=fits - 64) == "quantized"


def test_metal_and_float_models_keep_what_is_stored():
    assert default_dtype(dense(), on_cpu=False, cuda_memory=None) == "quantized"  # no CUDA device: Metal
    assert default_dtype(dense(quantize=False), on_cpu=False, cuda_memory=80 * GIB) == "float32"


def test_a_quantized_moe_stays_quantized_on_cuda():
    assert default_dtype(quantized_moe(), on_cpu=False, cuda_memory=80 * GIB) == "quantized"
