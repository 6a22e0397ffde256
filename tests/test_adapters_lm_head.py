"""An adapter on lm_head: the engine projects only the positions it samples (engine.head), so the
adapted head sees fewer tokens than the pass's rows x length, and a mixed batch's per-row (or, in a
packed pass, per-token) slots must follow the positions picked. Every row, pass shape and update
form (dense, gather) must equal its adapter served alone and mlx-lm's own LoRA / DoRA model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers

from parallm.adapters import lora, save_bytes
from tests._adapter_helpers import adapter_tensors
from tests._engine_helpers import COMMON, greedy, make_engine, reference_greedy, req, run_all

RANK, SCALE = 4, 2.0
PROMPTS = {"": [3, 4, 5], "a": [7, 8, 9, 10, 11], "d": [20, 21, 22, 23]}
ADAPTERS = {"a": dict(seed=1, dora=False), "d": dict(seed=2, dora=True)}
FORMS = pytest.mark.parametrize("dense_columns", [lora.DENSE_COLUMNS, 0], ids=["dense", "gather"])


def _untied() -> nn.Module:
    """The tests' tiny llama with its own lm_head (the default ties it to the embedding)."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **COMMON))
    model.update(nn.utils.tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def _reference(seed: int, dora: bool) -> tuple[nn.Module, dict]:
    """mlx-lm's LoRA (or DoRA) model on q_proj and lm_head, random non-zero weights, and its config."""
    model = _untied()
    mx.random.seed(seed)
    model.freeze()
    params = {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": ["self_attn.q_proj"]}
    linear_to_lora_layers(model, len(model.layers), params, use_dora=dora)
    model.lm_head = (DoRALinear if dora else LoRALinear).from_base(model.lm_head, r=RANK, scale=SCALE)
    new = [(k, v * (1.0 + 0.2 * mx.random.uniform(shape=v.shape)) if k.endswith(".m") else mx.random.normal(v.shape) * 0.3)
           for k, v in tree_flatten(model.trainable_parameters())]
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    assert "lm_head.lora_a" in adapter_tensors(model)
    return model, {"fine_tune_type": "dora" if dora else "lora", "num_layers": len(model.layers),
                   "lora_parameters": params | {"keys": params["keys"] + ["lm_head"]}}


@pytest.fixture(scope="module")
def refs() -> dict[str, nn.Module]:
    return {"": _untied()} | {name: _reference(**kw) for name, kw in ADAPTERS.items()}


def _engine(refs, **kw):
    engine = make_engine(_untied(), max_num_seqs=8, adapter_merge_mb=0, **kw)
    for name in ADAPTERS:
        model, config = refs[name]
        engine.load_adapter(name, config=config, weights=save_bytes(adapter_tensors(model)))
    return engine


def _prompt_logprobs(model: nn.Module, ids: list[int]) -> list[float]:
    """Each next token's logprob given the ones before it, from mlx-lm's model over the whole prompt."""
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(lp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0].tolist()


def _model(refs, name):
    return refs[""] if name == "" else refs[name][0]


@FORMS
@pytest.mark.parametrize("mixed_passes", [False, True], ids=["separate", "packed"])
def test_lm_head_adapter_rows_in_mixed_batches_match_alone_and_mlx_lm(refs, dense_columns, mixed_passes,
                                                                      monkeypatch):
    monkeypatch.setattr(lora, "DENSE_COLUMNS", dense_columns)
    alone = {}
    single = _engine(refs, mixed_passes=False)
    for name in PROMPTS:
        out = run_all(single, [req(rid=f"x{name}", prompt_ids=PROMPTS[name], params=greedy(8, logprobs=True),
                                   adapter=name)])[(f"x{name}", 0)]
        assert out["tokens"] == reference_greedy(_model(refs, name), PROMPTS[name], 8), name
        alone[name] = out
    engine = _engine(refs, mixed_passes=mixed_passes, max_prefill_tokens=16)
    mix = ["", "a", "d", "a", "", "d"]
    # three prompts under three adapters finish in one prefill pass; three more arrive while those
    # decode, their prompts prefilled beside the decode tokens where passes are packed
    arrivals = {step: [req(rid=f"m{i}", prompt_ids=PROMPTS[mix[i]], params=greedy(8, logprobs=True),
                           adapter=mix[i]) for i in rows] for step, rows in ((0, (0, 1, 2)), (2, (3, 4, 5)))}
    out = run_all(engine, arrivals=arrivals)
    for i, name in enumerate(mix):
        got = out[(f"m{i}", 0)]
        assert got["tokens"] == alone[name]["tokens"], (i, name)
        np.testing.assert_allclose(got["logprobs"], alone[name]["logprobs"], rtol=1e-4, atol=1e-4)
    assert engine.stats().adapters.passes["mixed"] > 0
    assert (engine.stats().mixed_passes > 0) == mixed_passes


@FORMS
def test_lm_head_adapter_scores_and_prompt_logprobs_beside_other_rows(refs, dense_columns, monkeypatch):
    monkeypatch.setattr(lora, "DENSE_COLUMNS", dense_columns)
    engine = _engine(refs)
    ids = [9, 8, 7, 6, 5, 4, 3]
    for i, name in enumerate(["", "d", "a"]):  # rows under the other adapters keep running
        engine.add_request(req(rid=f"bg{i}", prompt_ids=PROMPTS[name], params=greedy(12), adapter=name))
    engine.step()
    for name in ADAPTERS:
        want = _prompt_logprobs(refs[name][0], ids)
        scored = engine.score(ids, start=1, adapter=name)
        np.testing.assert_allclose(scored.logprobs, want, rtol=1e-4, atol=1e-4)
        rid = f"p{name}"
        engine.add_request(req(rid=rid, prompt_ids=ids, params=greedy(2, prompt_logprobs=0), adapter=name))
        got = run_all(engine)[(rid, 0)]["prompt_logprobs"][0]
        np.testing.assert_allclose([p for p in got if p is not None], want, rtol=1e-4, atol=1e-4)
