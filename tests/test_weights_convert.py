"""A full-weight update in another precision than the served model's (parallm/engine/weights_convert.py):
a quantized checkpoint into a model served dequantized, a float one into a quantized served model, and
what cannot be converted refused up front, naming why, with nothing applied."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from _engine_helpers import greedy, reference_greedy, req, run_all, tiny_model
from parallm.config import Config, EngineConfig, ModelConfig
from parallm.engine import Engine, EngineModel
from parallm.engine.weights import WeightsError
from parallm.models.dtype import apply_dtype

PROMPT = list(range(5, 30))


def engine_on(model) -> Engine:
    return Engine(EngineModel(model, [0], 256, 101), Config(engine=EngineConfig(block_size=8, kv_budget_mb=16)))


def params(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def quantized(seed: int, bits: int = 4, group_size: int = 32) -> nn.Module:
    model = tiny_model("llama", seed)
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def test_a_quantized_checkpoint_loads_into_a_dequantized_served_model(tmp_path):
    new = quantized(1)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), params(new))
    reference = quantized(1)
    apply_dtype(reference, "float32")          # what the server would serve from that checkpoint
    e = engine_on(tiny_model("llama", 0))      # served float32
    applied = e.update_weights(path=str(tmp_path))
    assert applied.tensors == len(params(reference))
    served = params(e.model)
    for name, value in params(reference).items():
        assert mx.array_equal(served.get(name, served.get(name.replace(".weight", ".linear.weight"))), value).item(), name
    out = run_all(e, [req("a", PROMPT, greedy(6))])
    assert out[("a", 0)]["tokens"] == reference_greedy(reference, PROMPT, 6)


def test_a_float_checkpoint_is_requantized_into_a_quantized_served_model():
    new = tiny_model("llama", 1)
    e = engine_on(quantized(0, bits=8, group_size=32))
    e.update_weights(tensors=params(new))
    reference = tiny_model("llama", 1)
    nn.quantize(reference, group_size=32, bits=8)   # quantized as the served layers are
    served = params(e.model)
    for name, value in params(reference).items():
        assert mx.allclose(served[name], value).item(), name
    out = run_all(e, [req("a", PROMPT, greedy(6))])
    assert out[("a", 0)]["tokens"] == reference_greedy(reference, PROMPT, 6)


def test_another_quantization_is_converted_and_a_bad_one_refused_changing_nothing(tmp_path):
    e = engine_on(quantized(0, bits=4, group_size=32))
    e.update_weights(tensors=params(quantized(1, bits=8, group_size=64)))   # dequantized, then 4-bit again
    assert e.model.layers[0].self_attn.q_proj.bits == 4
    before = params(e.model)
    bad = params(quantized(2, bits=4, group_size=32))
    bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"][:, :3]   # 3 packed columns
    with pytest.raises(WeightsError, match="no quantization of the served layer"):
        e.update_weights(tensors=bad)
    orphan = {"model.layers.0.mlp.up_proj.scales": before["model.layers.0.mlp.up_proj.scales"]}
    with pytest.raises(WeightsError, match="without its"):
        engine_on(tiny_model("llama", 0)).update_weights(tensors=orphan)
    assert all(mx.array_equal(v, before[k]).item() for k, v in params(e.model).items())


def test_the_default_models_own_directory_loads_into_the_model_served_from_it():
    """The issue's case (POST /update_weights_from_disk with the served default model's own directory):
    the model served in float32 on the CPU, dequantized from its 4-bit directory, takes an update from
    that very directory, every tensor dequantized as at load, so its logits do not move."""
    from parallm.engine.weights import WeightSwapper
    from parallm.models import load_model

    loaded = load_model(ModelConfig(dtype="float32"))
    ids = mx.array([[1, 504, 3458, 282, 2]])
    before = loaded.model(ids)
    applied = WeightSwapper(loaded.model).apply_dir(loaded.source.path)
    assert applied.tensors == len(params(loaded.model)) and applied.layers == len(loaded.model.layers) + 1
    assert all(v.dtype == mx.float32 for v in params(loaded.model).values())
    assert mx.array_equal(loaded.model(ids), before).item()
