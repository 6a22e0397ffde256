"""An adapter trained by mlx-lm's own LoRA trainer on the default model: same greedy tokens as
mlx-lm with that adapter, in mlx-lm's format and converted to PEFT's; the engine keeps serving
base rows beside it."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.tuner.datasets import CacheDataset, TextDataset
from mlx_lm.tuner.trainer import TrainingArgs, train
from mlx_lm.tuner.utils import linear_to_lora_layers

from parallm.config import ModelConfig

from parallm.models import load_model, materialize, resolve_model
from tests._adapter_helpers import to_peft
from tests._engine_helpers import greedy, make_engine, reference_greedy, run_all, req

TEXTS = ["The capital of France is Paris. The capital of Spain is Madrid.",
         "Two plus two is four. Three plus three is six.",
         "Cats purr when they are happy, and dogs wag their tails.",
         "Water boils at one hundred degrees Celsius at sea level."]
pytestmark = pytest.mark.slow  # ~2 CPU-minutes (training + three model loads); fast variants: test_adapters_engine.py

PROMPTS = [[1, 504, 3458, 282, 2], [1, 9690, 30, 422, 5248], [1, 7306, 253, 2096, 282, 260, 2361]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    path = materialize(resolve_model(ModelConfig(dtype="float32")), "float32")
    model, tokenizer = mlx_load(str(path))
    model.freeze()
    config = {"fine_tune_type": "lora", "num_layers": 4,
              "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    data = CacheDataset(TextDataset([{"text": t} for t in TEXTS], tokenizer))
    t0 = time.perf_counter()
    mx.random.seed(0)
    train(model, optim.Adam(learning_rate=2e-3), data, None,
          TrainingArgs(batch_size=2, iters=6, steps_per_report=1000, steps_per_eval=100000, steps_per_save=100000,
                       max_seq_length=64, adapter_file=str(out / "adapters.safetensors")))
    (out / "adapter_config.json").write_text(json.dumps(config))
    took = time.perf_counter() - t0
    # mlx-lm's reference: its own loader with the saved adapter, greedy decoding
    ref, _ = mlx_load(str(path), adapter_path=str(out))
    want = [reference_greedy(ref, p, 16) for p in PROMPTS]
    base = [reference_greedy(mlx_load(str(path))[0], p, 16) for p in PROMPTS[:1]]
    return out, config, want, base, took


def _engine():
    loaded = load_model(ModelConfig(dtype="float32"))
    return make_engine(loaded.model, max_model_len=2048)


def test_mlx_lm_trained_adapter_matches_mlx_lm_generate(trained):
    out, config, want, base, took = trained
    engine = _engine()
    a = engine.load_adapter("trained", path=str(out))
    assert (a.format, a.rank, len(a.modules)) == ("mlx", 8, 8)
    reqs = [req(rid=f"t{i}", prompt_ids=p, params=greedy(16), adapter="trained") for i, p in enumerate(PROMPTS)]
    reqs.append(req(rid="base", prompt_ids=PROMPTS[0], params=greedy(16)))
    res = run_all(engine, reqs)
    assert [res[(f"t{i}", 0)]["tokens"] for i in range(len(PROMPTS))] == want
    assert res[("base", 0)]["tokens"] == base[0]
    assert want[0] != base[0]  # the training changed the model's output


def test_same_adapter_as_peft_matches(trained):
    out, config, want, _, _ = trained
    tensors = mx.load(str(out / "adapters.safetensors"))
    peft_config, blob = to_peft(tensors, config)
    engine = _engine()
    engine.load_adapter("peft", config=peft_config, weights=blob)
    res = run_all(engine, [req(rid=f"p{i}", prompt_ids=p, params=greedy(16), adapter="peft")
                           for i, p in enumerate(PROMPTS)])
    assert [res[(f"p{i}", 0)]["tokens"] for i in range(len(PROMPTS))] == want
