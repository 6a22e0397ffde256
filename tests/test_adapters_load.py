"""Reading adapter weights: host-side finiteness checks, one MLX buffer per dtype, bit-exact views."""

from __future__ import annotations

import json
import math
import struct

import mlx.core as mx
import numpy as np
import pytest

from parallm.adapters import AdapterError, AdapterManager, load_bytes, parse, save_bytes
from parallm.adapters.safetensors_io import read_bytes
from tests._engine_helpers import tiny_model

CONFIG = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
UINT = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


def _lora(dtype=mx.float32, layers=2, dims=64, rank=4, seed=0, dora=False) -> dict[str, mx.array]:
    """q_proj [dims -> dims] and v_proj [dims -> dims // 2] of each layer (the tiny llama's shapes)."""
    mx.random.seed(seed)
    out = {}
    for i in range(layers):
        for proj, outs in (("q_proj", dims), ("v_proj", dims // 2)):
            path = f"model.layers.{i}.self_attn.{proj}"
            out[f"{path}.lora_a"] = (mx.random.normal((dims, rank)) * 0.3).astype(dtype)
            out[f"{path}.lora_b"] = (mx.random.normal((rank, outs)) * 0.3).astype(dtype)
            if dora:
                out[f"{path}.m"] = (1.0 + mx.random.uniform(shape=(outs,))).astype(dtype)
    return out


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(UINT[a.dtype]))


def _same_bits(got: mx.array, want: mx.array) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(_bits(got), _bits(want))


def _blob(entries: list[tuple[str, str, tuple, bytes]], order: list[int]) -> bytes:
    """A safetensors blob whose data lies in `order` (a permutation of entries), not header order, and starts
    at an odd offset (no alignment)."""
    offsets, at = {}, 0
    for i in order:
        offsets[i] = (at, at + len(entries[i][3]))
        at += len(entries[i][3])
    header = {name: {"dtype": code, "shape": list(shape), "data_offsets": list(offsets[i])}
              for i, (name, code, shape, _) in enumerate(entries)}
    head = json.dumps(header).encode()
    head += b" " * ((1 - len(head)) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(entries[i][3] for i in order)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_are_bit_exact(dtype):
    tensors = {**_lora(dtype), "scalar": mx.array(-0.0, dtype=dtype), "empty": mx.zeros((0, 3), dtype=dtype),
               "tiny": mx.array([6e-8, -1e-40, 65504.0], dtype=mx.float32).astype(dtype)}
    got = load_bytes(save_bytes(tensors))
    assert list(got) == sorted(tensors)
    for name, t in tensors.items():
        assert _same_bits(got[name], t), name


def test_mixed_dtypes_out_of_order_and_unaligned():
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((5, 3)).astype(np.float32)
    f16 = rng.standard_normal((7,)).astype(np.float16)
    bf16 = rng.integers(0, 0x7F00, size=(2, 3), dtype=np.uint16)
    f64 = np.array([1.5, -2.25, 1e-3])
    i32 = np.arange(4, dtype=np.int32)
    entries = [("a", "F32", f32.shape, f32.tobytes()), ("b", "BF16", bf16.shape, bf16.tobytes()),
               ("c", "F16", f16.shape, f16.tobytes()), ("d", "F32", (2,), np.float32([3, 4]).tobytes()),
               ("e", "F64", f64.shape, f64.tobytes()), ("f", "I32", i32.shape, i32.tobytes())]
    got = load_bytes(_blob(entries, [3, 1, 5, 0, 4, 2]))
    assert list(got) == list("abcdef")
    assert np.array_equal(np.array(got["a"]), f32) and np.array_equal(np.array(got["c"]), f16)
    assert got["b"].dtype == mx.bfloat16 and np.array_equal(np.array(got["b"].view(mx.uint16)), bf16)
    assert np.array_equal(np.array(got["d"]), [3, 4])
    assert got["e"].dtype == mx.float32 and np.array_equal(np.array(got["e"]), f64.astype(np.float32))
    assert got["f"].dtype == mx.int32 and np.array_equal(np.array(got["f"]), i32)


def test_tensors_are_views_of_one_buffer_per_dtype():
    tensors = _lora(mx.float32, layers=8, dims=256, rank=16)  # 32 tensors, 1 MiB
    blob = save_bytes(tensors)
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    got = load_bytes(blob)
    grew, peak = mx.get_active_memory() - before, mx.get_peak_memory() - before
    data = sum(t.nbytes for t in tensors.values())
    assert data <= grew <= peak < 1.5 * data  # a copy per tensor would peak at twice the data
    assert all(_same_bits(got[n], t) for n, t in tensors.items())


BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", list(BAD))
def test_host_check_names_the_nonfinite_tensor(dtype, bad):
    tensors = _lora(dtype)
    name = "model.layers.1.self_attn.q_proj.lora_b"
    tensors[name] = mx.concatenate([tensors[name].reshape(-1)[:-1],
                                    mx.array([BAD[bad]], dtype=dtype)]).reshape(tensors[name].shape)
    blob = save_bytes(tensors)
    assert read_bytes(blob)[1] == [name]
    with pytest.raises(AdapterError, match=rf"^tensor '{name}' holds NaN or infinite values$"):
        parse(CONFIG, blob)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_largest_finite_16_bit_values_pass(dtype):
    top = {mx.float16: 0x7BFF, mx.bfloat16: 0x7F7F}[dtype]
    bits = mx.array([top, top | 0x8000, 0x0001, 0x8000, 0x0000], dtype=mx.uint16).view(dtype)
    assert read_bytes(save_bytes({"x": bits}))[1] == []
    nonfinite = mx.array([top + 1, top + 2, 0xFFFF], dtype=mx.uint16).view(dtype)  # inf, a NaN, a NaN
    for i in range(3):
        assert read_bytes(save_bytes({"x": bits, "y": nonfinite[i:i + 1]}))[1] == ["y"]


def test_f64_that_overflows_float32_is_rejected():
    entries = [("model.layers.0.self_attn.q_proj.lora_a", "F64", (2,), np.float64([1.0, 1e300]).tobytes())]
    assert read_bytes(_blob(entries, [0]))[1] == [entries[0][0]]


def test_many_nonfinite_tensors_are_summarised_in_header_order():
    tensors = {k: v * math.nan for k, v in _lora(mx.bfloat16, layers=2).items()}
    names = sorted(tensors)
    want = rf"^tensor '{names[0]}', '{names[1]}', '{names[2]}' \(and 5 more\) holds NaN or infinite values$"
    with pytest.raises(AdapterError, match=want):
        parse(CONFIG, save_bytes(tensors))
    with pytest.raises(AdapterError, match=want):
        parse(CONFIG, {n: tensors[n] for n in names})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dict_input_still_rejects_nonfinite(dtype):
    tensors = _lora(dtype)
    name = "model.layers.0.self_attn.v_proj.lora_a"
    tensors[name] = tensors[name] * math.inf
    with pytest.raises(AdapterError, match=rf"'{name}' holds NaN"):
        parse(CONFIG, tensors)
    assert parse(CONFIG, _lora(dtype)).rank == 4


def test_structural_errors_come_before_nonfinite_ones():
    tensors = {k: v * math.nan for k, v in _lora().items()}
    with pytest.raises(AdapterError, match="rank 4 differs"):
        parse({**CONFIG, "lora_parameters": {"rank": 8, "scale": 1.0}}, save_bytes(tensors))
    with pytest.raises(AdapterError, match="dtype int32"):
        parse(CONFIG, save_bytes({**tensors, "x.lora_a": mx.zeros((2, 2), dtype=mx.int32)}))


def test_malformed_sizes_are_adapter_errors():
    entries = [("a", "F32", (2,), b"\x00" * 7)]
    with pytest.raises(AdapterError, match="7 data bytes are not a whole number of F32 values"):
        load_bytes(_blob(entries, [0]))
    with pytest.raises(AdapterError, match="values do not fill shape"):
        load_bytes(_blob([("a", "F32", (3,), b"\x00" * 8)], [0]))
    with pytest.raises(AdapterError, match="not a list of non-negative integers"):
        load_bytes(_blob([("a", "F32", (-1, -2), b"\x00" * 8)], [0]))


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("stored", DTYPES, ids=str)
def test_bytes_cast_once_per_group_match_per_module_casts(stored, dora):
    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    tensors = _lora(stored, dora=dora)
    config = {**CONFIG, "fine_tune_type": "dora" if dora else "lora"}
    manager = AdapterManager(model)
    assert manager.dtype == mx.bfloat16
    from_bytes = manager.load("b", config=config, weights=save_bytes(tensors))
    from_dict = manager.load("d", config=config, weights=tensors)  # cast module by module in _bind
    for path, m in from_bytes.modules.items():
        ref = from_dict.modules[path]
        assert m.a.dtype == m.b.dtype == mx.bfloat16
        assert _same_bits(m.a, ref.a) and _same_bits(m.b, ref.b)
        assert (m.m is None) == (not dora)
        if dora:
            assert m.m.dtype == mx.float32 and _same_bits(m.m, ref.m)
            assert _same_bits(from_bytes.gains[path], from_dict.gains[path])
