"""What the first GPU runs of issue 19's engine found (H200, bf16 and 4-bit MoE models), kept on the
CPU: a 4-bit MoE's QuantizedSwitchLinear layers go through the dtype policy, and the load probe
tells a batched kernel's own rounding from a per-row position error."""

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from parallm.engine import UnsupportedModel
from parallm.engine.compat import check_model
from parallm.models import tiny
from parallm.models.dtype import apply_dtype

MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
       "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
       "mlp_only_layers": [], "norm_topk_prob": True, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 256, "rope_theta": 10000.0,
       "tie_word_embeddings": False, "max_position_embeddings": 512}


def quantized_moe() -> nn.Module:
    arch = importlib.import_module("mlx_lm.models.qwen3_moe")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(MOE))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def test_a_4bit_moe_keeps_its_quantized_experts():
    model = quantized_moe()
    assert apply_dtype(model, None if mx.default_device() != mx.cpu else "quantized") == "quantized"
    assert isinstance(model.model.layers[0].mlp.switch_mlp.up_proj, QuantizedSwitchLinear)


def test_a_4bit_moe_is_dequantized_to_float_experts_with_the_same_logits():
    model = quantized_moe()
    ids = mx.array([[3, 17, 42, 99, 7]])
    want = model(ids)
    assert apply_dtype(model, "float32") == "float32"
    assert isinstance(model.model.layers[0].mlp.switch_mlp.up_proj, SwitchLinear)
    assert not any(k.endswith("scales") for k, _ in tree_flatten(model.parameters()))
    assert mx.allclose(model(ids), want, atol=1e-3, rtol=1e-3).item()


def _with_batch_rounding(model: nn.Module, size: float) -> nn.Module:
    """`model` whose passes over more than one row come out shifted by `size` (the same for every
    row layout), as a GPU's batched bf16 kernels round differently from its batch-1 kernels."""
    base = type(model)

    class BatchRounding(base):
        def __call__(self, inputs, *args, **kwargs):
            out = base.__call__(self, inputs, *args, **kwargs)
            if inputs.shape[0] > 1:
                out = out + (size * mx.sin(mx.arange(out.shape[-1]))).astype(out.dtype)
            return out

    model.__class__ = BatchRounding
    return model


def _bf16(model: nn.Module) -> nn.Module:
    model.set_dtype(mx.bfloat16)
    return model


def test_the_probe_accepts_a_batched_kernels_own_rounding():
    model, _ = tiny.build_any("llama")
    check_model(_with_batch_rounding(_bf16(model), 0.5))


@pytest.mark.parametrize("name", ["afm7", "gpt_bigcode"])
def test_the_probe_still_refuses_position_errors_in_bfloat16(name):
    model, _ = tiny.build_any(name)
    model.model_type = f"{name}-unadapted"  # mlx-lm's own forward, without parallm.engine.families' per-row positions
    with pytest.raises(UnsupportedModel, match="different lengths"):
        check_model(_bf16(model))


def test_recurrent_state_rows_are_fitted_to_the_budget():
    """A hybrid model's per-row state may take half the KV budget: max_num_seqs shrinks to what fits
    and every request is still served (on the H200, 256 rows of a 4B hybrid's state took the whole
    budget and every request was refused with a 400)."""
    from _engine_helpers import greedy, make_engine, reference_greedy, run_all

    from parallm.engine import make_request

    model, _ = tiny.build_any("qwen3_5")
    row = make_engine(model, max_num_seqs=1).runner.info.layout.state_bytes_per_row
    engine = make_engine(model, max_num_seqs=64, kv_budget_bytes=8 * row)
    assert engine.config.max_num_seqs == 4
    prompts = [[3 + i, 9, 4, 1 + i, 7][: 3 + i % 3] for i in range(6)]
    results = run_all(engine, [make_request(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert results[(f"r{i}", 0)]["tokens"] == reference_greedy(model, p, 6)
    with pytest.raises(ValueError, match="recurrent state"):
        make_engine(model, kv_budget_bytes=row)
