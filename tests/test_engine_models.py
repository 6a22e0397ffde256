"""The dense architectures, tiny random weights: the engine's greedy tokens equal mlx-lm's."""

import random

import mlx.nn as nn
import pytest

from _engine_helpers import TINY_MODELS, TINY_VOCAB, greedy, make_engine, reference_greedy, run_all, tiny_model, req
from parallm.engine import UnsupportedModel


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_matches_mlx_lm(name):
    model = tiny_model(name)
    rng = random.Random(1)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (1, 3, 9, 17, 30)]
    refs = [reference_greedy(model, p, 12) for p in prompts]
    # small chunk budget: several prefill chunks and padded multi-row passes
    engine = make_engine(model, max_prefill_tokens=16)
    reqs = [req(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    res = run_all(engine, reqs[:3], arrivals={4: reqs[3:]})
    for i, ref in enumerate(refs):
        assert res[(f"r{i}", 0)]["tokens"] == ref, f"{name} prompt {i}"
        assert res[(f"r{i}", 0)]["finish"] == "length"
    engine.check_integrity()
    # the late prompts were prefilled in the running rows' decode passes, except where the
    # architecture's attention is its own (gemma2 soft-caps its scores) rather than mlx-lm's
    assert (engine.stats().mixed_passes > 0) == engine.runner.can_pack
    assert engine.runner.can_pack or name == "gemma2"


class _NotAModel(nn.Module):
    model_type = "not_a_model"

    def __call__(self, x, cache=None):
        return x


def test_a_model_the_views_cannot_drive_is_refused():
    with pytest.raises(UnsupportedModel, match="neither make_cache"):
        make_engine(_NotAModel())
    m = tiny_model("llama")
    m.model_type = "plamo3"
    with pytest.raises(UnsupportedModel, match="'plamo3' is not served: mlx-lm's plamo3"):
        make_engine(m)


def test_dynamic_ntk_rope_is_refused():
    from mlx_lm.models import llama
    from _engine_helpers import COMMON
    m = llama.Model(llama.ModelArgs(model_type="llama", rope_scaling={"type": "dynamic", "factor": 2.0},
                                    max_position_embeddings=64, **COMMON))
    with pytest.raises(UnsupportedModel, match="NTK"):
        make_engine(m)
