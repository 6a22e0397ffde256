"""The trainer's memory plan, micro-batches from a budget and per-layer gradient checkpointing
(parallm/training/memory.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

from parallm.config import LoRATrainConfig, ModelConfig
from parallm.training.grpo import GRPOUpdater, LossConfig, Sample, make_batch
from parallm.training.memory import TrainerMemoryError, checkpoint_layers, make_plan, model_shape
from parallm.training.policy import load_policy
from tests._train_models import quantized_model_dir


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    return quantized_model_dir(tmp_path_factory.mktemp("q4") / "tiny-q4")


def _policy(path, seed=0):
    return load_policy(ModelConfig(path=str(path), dtype="quantized"), LoRATrainConfig(rank=4, num_layers=2), seed=seed)


def test_the_plan_counts_quantized_weights_as_stored_and_a_budget_sizes_the_micro_batch(q4_dir):
    policy = _policy(q4_dir)
    shape = model_shape(policy.model)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.vocab) == (2, 64, 128, 4, 49152)
    free = make_plan(policy.model, trainable=policy.trainable_count(), seq_len=64, micro_batch=8, grad_checkpoint=None)
    assert free.micro_batch == 8 and not free.grad_checkpoint   # 3M parameters: below the 1B default
    assert free.weights == sum(v.nbytes for _, v in tree_flatten(policy.model.parameters()))
    assert free.weights < shape.params * 4 / 4                  # 4-bit packed: far less than float32
    budget = (free.weights + free.optimizer + 3.5 * free.per_sequence) / 2 ** 20
    tight = make_plan(policy.model, trainable=policy.trainable_count(), seq_len=64, micro_batch=8,
                      grad_checkpoint=None, budget_mb=budget, engine_kv=64 * 2 ** 20)
    assert tight.micro_batch == 3
    assert any("engine KV budget 64 MiB" in line for line in tight.lines())
    with pytest.raises(TrainerMemoryError, match="holds no micro-batch"):
        make_plan(policy.model, trainable=policy.trainable_count(), seq_len=64, micro_batch=8, grad_checkpoint=None,
                  budget_mb=free.weights / 2 ** 20)
    checked = make_plan(policy.model, trainable=policy.trainable_count(), seq_len=64, micro_batch=8,
                        grad_checkpoint=True)
    assert checked.per_sequence < free.per_sequence


def test_checkpointed_layers_give_the_same_gradients_and_touch_no_other_model(q4_dir):
    samples = [Sample(prompt_ids=[1, 5, 6, 7], completion_ids=[8, 9, 10, 11], sampler_logprobs=[-10.8] * 4,
                       advantage=a) for a in (1.0, -1.0, 0.5)]
    grads = []
    for checkpointed in (False, True):
        policy = _policy(q4_dir)
        for name, value in policy.adapter_weights().items():   # B != 0, so every adapter tensor gets a gradient
            if name.endswith("lora_b"):
                policy.model.load_weights([(name, mx.ones(value.shape) * 0.01)], strict=False)
        names = sorted(k for k, _ in tree_flatten(policy.model.parameters()))
        if checkpointed:
            assert checkpoint_layers(policy.model) == 2
            assert sorted(k for k, _ in tree_flatten(policy.model.parameters())) == names
        updater = GRPOUpdater(policy.model, optim.SGD(learning_rate=0.0), LossConfig())
        (loss, _), g = updater._loss_and_grad(make_batch(samples), 12.0)
        grads.append((loss.item(), dict(tree_flatten(g))))
    (loss_a, a), (loss_b, b) = grads
    assert loss_a == pytest.approx(loss_b, rel=1e-5) and a.keys() == b.keys()
    for k in a:
        assert mx.allclose(a[k], b[k], rtol=1e-4, atol=1e-6).item(), k
    other = _policy(q4_dir)   # a model built after: its layers are the plain class
    assert not type(other.model.layers[0]).__name__.startswith("Checkpointed")
    assert isinstance(other.model.layers[0], nn.Module)


def test_the_update_reports_progress_after_every_micro_batch(q4_dir):
    """The supervised trainer's heartbeat: an update of many micro-batches is not a stall."""
    policy = _policy(q4_dir)
    beats = []
    updater = GRPOUpdater(policy.model, optim.Adam(learning_rate=1e-3), LossConfig(), micro_batch=2,
                          progress=lambda: beats.append(1))
    updater.step([Sample(prompt_ids=[1, 5], completion_ids=[8, 9], sampler_logprobs=[-10.8] * 2, advantage=a)
                  for a in (1.0, -1.0, 0.5, -0.5, 1.0)])
    assert len(beats) == 3   # 5 sequences in micro-batches of 2
