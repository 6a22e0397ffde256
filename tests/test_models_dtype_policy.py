"""The weights' dtype policy per backend (parallm/models/dtype.py), with the device queries stubbed
(parallm.device, as the engine's device tests do): float32 on the CPU; on a CUDA GPU a quantized dense
checkpoint is served in bfloat16 when its bfloat16 weights and the KV budget fit the device, else kept
quantized; Metal keeps what is stored; model.quantized_weights forces either way. The served model's
greedy tokens are the quantized model's."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import quantize_model

from parallm import device
from parallm.config import Config, ConfigError, EngineConfig, ModelConfig, build_config
from parallm.engine import Engine, EngineModel
from parallm.models import ModelLoadError, load_model, resolve_model
from parallm.models.dtype import (CUDA_KV_RESERVE_SHARE, CUDA_USABLE_SHARE, choose_dtype, cuda_fits,
                                  dequantized_bytes)
from parallm.models import tiny
from tests._engine_helpers import COMMON, greedy, req, run_all
from tests.test_models_gpu_regressions import quantized_moe

GIB = 1 << 30


def dense(quantize: bool = True) -> nn.Module:
    model, _ = tiny.build("llama")
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.fixture
def backend(monkeypatch):
    """Stub MLX's backend as parallm.device reports it: backend("cuda", total_bytes), ("metal"), ("cpu")."""
    def stub(name: str, total: int | None = None) -> None:
        monkeypatch.setattr(device, "compute_device", lambda: name)
        monkeypatch.setattr(device, "cuda_memory", lambda: (total, total) if name == "cuda" else None)
    return stub


def test_dequantized_bytes_counts_every_packed_value_once_and_drops_scales():
    plain = dense(quantize=False)
    want = sum(v.size for _, v in tree_flatten(plain.parameters())) * 2
    assert dequantized_bytes(plain, 2) == want
    assert dequantized_bytes(dense(), 2) == want


def test_the_cpu_serves_float32_unless_told_to_keep(backend):
    backend("cpu")
    assert choose_dtype(dense()).served == "float32"
    assert choose_dtype(dense(), quantized_weights="dequantize").served == "float32"
    keep = choose_dtype(dense(), quantized_weights="keep")
    assert (keep.stored, keep.served, keep.reason) == ("quantized", "quantized", "model.quantized_weights keep (configured)")


def test_cuda_dequantizes_when_the_bfloat16_weights_and_the_kv_reserve_fit(backend):
    model = dense()
    need = dequantized_bytes(model, 2)
    backend("cuda", 80 * GIB)
    choice = choose_dtype(model)
    assert choice.served == "bfloat16" and "dequantized" in choice.reason and "80.0 GiB" in choice.reason
    # the boundary: weights + CUDA_KV_RESERVE_SHARE of the device within CUDA_USABLE_SHARE of it
    fits = int(need / (CUDA_USABLE_SHARE - CUDA_KV_RESERVE_SHARE)) + 64
    assert cuda_fits(need, fits)[0] and not cuda_fits(need, fits - 256)[0]
    backend("cuda", fits)
    assert choose_dtype(model).served == "bfloat16"
    backend("cuda", fits - 256)
    kept = choose_dtype(model)
    assert kept.served == "quantized" and kept.reason.startswith("cuda: kept quantized")


def test_cuda_leaves_room_for_a_configured_kv_budget(backend):
    model = dense()
    need = dequantized_bytes(model, 2)
    total = 10 * need
    backend("cuda", total)
    assert choose_dtype(model, kv_budget_bytes=need).served == "bfloat16"
    assert choose_dtype(model, kv_budget_bytes=int(total * CUDA_USABLE_SHARE)).served == "quantized"


def test_the_flag_forces_either_way_on_cuda_and_metal(backend):
    backend("cuda", 100)  # bfloat16 does not fit
    assert choose_dtype(dense(), quantized_weights="dequantize").served == "bfloat16"
    backend("cuda", 80 * GIB)
    assert choose_dtype(dense(), quantized_weights="keep").served == "quantized"
    backend("metal")
    assert choose_dtype(dense()).served == "quantized"
    assert choose_dtype(dense(), quantized_weights="dequantize").served == "bfloat16"


def test_float_models_moe_and_model_dtype(backend):
    backend("cuda", 80 * GIB)
    assert choose_dtype(dense(quantize=False)).served == "float32"  # not quantized: as stored
    assert choose_dtype(quantized_moe()).served == "quantized"       # MoE experts: not measured
    assert choose_dtype(dense(), "float16").reason == "model.dtype float16 (configured)"
    with pytest.raises(ModelLoadError, match="contradicts"):
        choose_dtype(dense(), "quantized", "dequantize")


def test_the_config_refuses_contradicting_settings_and_reads_auto():
    with pytest.raises(ConfigError, match="model.dtype bfloat16 contradicts model.quantized_weights keep"):
        build_config(environ={}, cli={"model": {"dtype": "bfloat16", "quantized_weights": "keep"}})
    assert build_config(environ={}, cli={"model": {"quantized_weights": "dequantize"}}).model.quantized_weights == "dequantize"
    assert build_config(environ={"PARALLM_MODEL__QUANTIZED_WEIGHTS": "auto"}).model.quantized_weights is None


def _quantized_dir(out: Path, dtype: mx.Dtype) -> Path:
    """A tiny llama whose `dtype` weights are stored 4-bit in groups of 32 (mlx_lm's quantize)."""
    config = dict(model_type="llama", eos_token_id=2, max_position_embeddings=512, **COMMON)
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # spread the random weights so the logits are far from ties
    model.update(nn.utils.tree_map(lambda p: (p * 3.0 if p.ndim == 2 else p).astype(dtype), model.parameters()))
    model, config = quantize_model(model, config, group_size=32, bits=4)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    source = resolve_model(ModelConfig()).path  # the loader wants tokenizer files; the engine reads none
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(source / name, out / name)
    return out


def _greedy_tokens(loaded) -> tuple[dict, dict]:
    engine = Engine(EngineModel.of(loaded), Config(engine=EngineConfig(max_num_seqs=4)))
    prompts = [[5, 9, 13, 2, 77], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46], [99]]
    out = run_all(engine, [req(f"r{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    return {rid: o["tokens"] for rid, o in out.items()}, engine.stats().weight_dtype


def test_served_dequantized_the_greedy_tokens_are_the_quantized_models(tmp_path, backend):
    """float32 scales: the dequantized weights are exact, so the tokens are equal (MLX's CPU device
    serves a quantized checkpoint this way by default)."""
    path = str(_quantized_dir(tmp_path / "q4", mx.float32))
    backend("cpu")
    served, kept = load_model(ModelConfig(path=path)), load_model(ModelConfig(path=path, quantized_weights="keep"))
    assert (served.dtype, kept.dtype) == ("float32", "quantized")
    (want, kept_stats), (got, served_stats) = _greedy_tokens(kept), _greedy_tokens(served)
    assert got == want
    assert served_stats == {"stored": "quantized", "served": "float32", "reason": served.dtype_choice.reason}
    assert kept_stats["served"] == "quantized"


def test_a_stubbed_cuda_device_serves_mlx_dequantized_bfloat16_no_worse_than_the_quantized_kernels(tmp_path, backend):
    """In bfloat16 the dequantized weights are mx.dequantize's, rounded once; their logits sit closer to the
    exact (float32) dequantized model's than the quantized kernels' bfloat16 pass does (greedy tokens of a
    random model then part within a few tokens either way, so the logits are compared)."""
    path = str(_quantized_dir(tmp_path / "q4", mx.bfloat16))
    backend("cuda", 80 * GIB)  # only the dtype policy asks: the engine still computes on the CPU
    served = load_model(ModelConfig(path=path))
    assert served.dtype == "bfloat16" and "dequantized" in served.dtype_choice.reason
    assert not any(k.endswith("scales") for k, _ in tree_flatten(served.model.parameters()))
    kept = load_model(ModelConfig(path=path, quantized_weights="keep"))
    q = kept.model.model.layers[0].self_attn.q_proj
    want = mx.dequantize(q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32), q.group_size, q.bits)
    assert mx.array_equal(served.model.model.layers[0].self_attn.q_proj.weight, want.astype(mx.bfloat16)).item()
    exact = load_model(ModelConfig(path=path, dtype="float32")).model
    ids = mx.array([[5, 9, 13, 2, 77, 1, 2, 3, 40, 41]])
    ref = exact(ids)
    error = {name: mx.abs(m.model(ids).astype(mx.float32) - ref).mean().item()
             for name, m in (("served", served), ("kept", kept))}
    assert error["served"] <= error["kept"], error
