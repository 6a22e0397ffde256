"""Every model family the engine serves, as tiny random-weight mlx-lm models (parallm.models.tiny):
greedy tokens equal mlx-lm's own single-sequence decoding for staggered batched prompts, n = 3
forks, a prefix-cache hit and a forced preemption, all through the engine."""

import random

import pytest
from _engine_helpers import greedy, make_engine, reference_greedy, req, run_all

from parallm.engine import UnsupportedModel
from parallm.models import tiny

# one model per family and flavour (the whole matrix is docs/models.md, tests/test_models_matrix.py)
FAMILIES = {
    "qwen3_moe": "MoE, softmax top-k routing",
    "mixtral": "MoE, Mixtral routing",
    "glm4_moe": "MoE with shared experts, grouped routing, partial RoPE",
    "dbrx": "MoE with per-expert Linear modules",
    "gpt_oss": "MoE + alternating sliding/full attention + attention sinks",
    "cohere2": "sliding window, alternating local/global",
    "deepseek_v3": "MLA (latent cache) + MoE",
    "deepseek_v2": "MLA (expanded per-head cache)",
    "gemma4_text": "KV shared across layers (fewer cache slots than layers)",
    "nanbeige+loops": "two loops over the layers (twice as many cache slots as layers)",
}


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(tiny.V) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_mlx_lm(name):
    model, _ = tiny.build_any(name)
    prompts = _prompts(1, (3, 9, 17, 30))
    refs = [reference_greedy(model, p, 10) for p in prompts]
    engine = make_engine(model, max_prefill_tokens=16, block_size=4)
    reqs = [req(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    forked = req("n3", prompts[2], greedy(10), n=3)
    res = run_all(engine, reqs[:2], arrivals={2: reqs[2:3] + [forked], 5: reqs[3:]})
    for i, ref in enumerate(refs):
        assert res[(f"r{i}", 0)]["tokens"] == ref, f"{name}: prompt {i}"
    for k in range(3):
        assert res[("n3", k)]["tokens"] == refs[2], f"{name}: fork {k}"

    # a prefix hit: the longest prompt's first 24 tokens, then new ones
    follow = prompts[3][:24] + _prompts(2, (6,))[0]
    hits = engine.stats().prefix_hit_tokens
    res = run_all(engine, [req("p", follow, greedy(10))])
    assert engine.stats().prefix_hit_tokens - hits >= 16, name
    assert res[("p", 0)]["tokens"] == reference_greedy(model, follow, 10), f"{name}: after a prefix hit"

    # 96 live token slots for four sequences that grow to 27-54 tokens: one is preempted and recomputed
    bpt = engine.runner.live.bytes_per_token
    tight = make_engine(model, max_prefill_tokens=16, block_size=4, kv_budget_bytes=bpt * 128,
                        prefix_pool_fraction=0.25)
    res = run_all(tight, [req(f"t{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    assert tight.stats().preemptions > 0, name
    for i, p in enumerate(prompts):
        assert res[(f"t{i}", 0)]["tokens"] == reference_greedy(model, p, 24), f"{name}: preempted prompt {i}"


@pytest.mark.parametrize("name, reason", [
    ("mamba2", "ArraysCache"), ("falcon_h1", "CacheList"), ("gemma3n", "keys_and_values"),
    ("gpt_bigcode", "rows of different lengths"), ("plamo3", "window"),
])
def test_what_cannot_be_served_is_refused_at_load(name, reason):
    model, _ = tiny.build_any(name)
    with pytest.raises(UnsupportedModel, match=reason):
        make_engine(model)
