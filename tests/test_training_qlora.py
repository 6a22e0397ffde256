"""QLoRA: the trainer keeps a quantized base quantized and trains LoRA/DoRA over its quantized layers;
its checkpoints load in mlx-lm on the same quantized base with equal logits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest

from parallm.config import LoRATrainConfig, ModelConfig
from parallm.training import checkpoint
from parallm.training.grpo import GRPOUpdater, LossConfig, Sample
from parallm.training.policy import load_policy

from tests._train_models import quantized_model_dir


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    return quantized_model_dir(tmp_path_factory.mktemp("q4") / "tiny-q4")


def _samples() -> list[Sample]:
    return [Sample(prompt_ids=[1, 5, 6, 7], completion_ids=[8, 9, 10], sampler_logprobs=[-10.8] * 3, advantage=a)
            for a in (1.0, -1.0)]


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_quantized_base_stays_quantized_and_its_adapter_trains_and_loads_in_mlx_lm(q4_dir, tmp_path, kind):
    from mlx_lm.utils import load as mlx_lm_load

    lora = LoRATrainConfig(rank=4, num_layers=2, fine_tune_type=kind)
    policy = load_policy(ModelConfig(path=str(q4_dir), dtype="quantized"), lora)
    assert policy.dtype == "quantized"
    q_proj = policy.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.linear, nn.QuantizedLinear)  # the adapter wraps the quantized layer
    before = {k: mx.array(v) for k, v in policy.adapter_weights().items()}
    optimizer = optim.Adam(learning_rate=1e-2)
    updater = GRPOUpdater(policy.model, optimizer, LossConfig())
    for _ in range(2):
        stats = updater.step(_samples())
    assert stats.grad_norm > 0 and stats.logprob_gap_mean > 0
    moved = [k for k, v in policy.adapter_weights().items() if not mx.array_equal(v, before[k]).item()]
    assert moved and all(k.endswith(("lora_a", "lora_b", "m")) for k in moved)
    assert all(v.dtype == mx.uint32 for k, v in _frozen(policy.model) if k.endswith(".weight") and "proj" in k)

    path = checkpoint.save(tmp_path, 2, weights=policy.adapter_weights(), adapter_config=policy.adapter_config,
                           optimizer=optimizer, state={"version": 3})
    ids = mx.array([[1, 504, 3458, 282, 17]])
    model, _ = mlx_lm_load(str(q4_dir), adapter_path=str(path))  # mlx_lm.generate --adapter-path's loader
    assert isinstance(model.layers[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    assert mx.allclose(model(ids), policy.model(ids), atol=1e-5).item()


def _frozen(model: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    return [(k, v) for k, v in tree_flatten(model.parameters()) if k not in trainable]


def test_unset_dtype_is_the_served_precision(q4_dir):
    policy = load_policy(ModelConfig(path=str(q4_dir)), LoRATrainConfig(rank=2, num_layers=1))
    # the engine's policy on MLX's CPU device: float32 (dequantized); elsewhere as stored
    expected = "float32" if mx.default_device() == mx.cpu else "quantized"
    assert policy.dtype == expected


def test_the_engine_serving_the_qlora_adapter_gives_the_trainers_logprobs(q4_dir):
    """The importance ratio's two sides on a quantized model: the engine, serving the 4-bit base with the
    trainer's published adapter version, samples tokens whose logprobs the trainer's forward matches."""
    from _engine_helpers import make_engine

    from parallm.adapters import save_bytes
    from parallm.engine import make_request
    from parallm.models import load_model
    from parallm.protocol import SamplingParams
    from parallm.training.grpo import make_batch, token_logprobs

    policy = load_policy(ModelConfig(path=str(q4_dir), dtype="quantized"), LoRATrainConfig(rank=4, num_layers=2))
    for name, value in policy.adapter_weights().items():   # a trained-looking adapter: B != 0
        if name.endswith("lora_b"):
            policy.model.load_weights([(name, mx.random.normal(value.shape) * 0.05)], strict=False)
    engine = make_engine(load_model(ModelConfig(path=str(q4_dir), dtype="quantized")).model)
    engine.load_adapter("pol", config=policy.adapter_config, weights=save_bytes(policy.adapter_weights()))
    prompt = [1, 504, 3458, 282, 17]
    engine.add_request(make_request("r", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=True,
                                                                ignore_eos=True), n=4, adapter="pol"))
    got: dict[int, tuple[list[int], list[float]]] = {}
    while engine.has_work():
        for out in engine.step():
            ids, lps = got.setdefault(out.index, ([], []))
            ids += out.token_ids
            lps += out.logprobs
    batch = make_batch([Sample(prompt_ids=prompt, completion_ids=ids, sampler_logprobs=lps) for ids, lps in got.values()])
    gap = mx.abs(token_logprobs(policy.model, batch.inputs, batch.targets) - batch.old_logprobs) * batch.mask
    print(f"4-bit engine vs trainer |logprob gap|: max {gap.max().item():.2e}, mean {gap.sum().item() / 48:.2e}")
    assert batch.mask.sum().item() == 48 and gap.max().item() < 1e-3
