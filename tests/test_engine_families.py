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
    "gpt_bigcode": "learned absolute positions looked up from the cache offset (an adapter)",
    "afm7": "KV-reuse layers attend over another layer's keys at its positions (an adapter)",
    "llama4": "chunked local attention + NoPE layers with position-dependent temperature (an adapter)",
    "deepseek_v3": "MLA (latent cache) + MoE",
    "deepseek_v2": "MLA (expanded per-head cache)",
    "deepseek_v32": "MLA + DeepSeek sparse attention: an indexer's top-k keys (an adapter)",
    "gemma4_text": "KV shared across layers (fewer cache slots than layers)",
    "gemma3n": "KV-sharing layers read the owner layer's keys_and_values()",
    "nanbeige+loops": "two loops over the layers (twice as many cache slots as layers)",
    # recurrent / hybrid: per-row state (parallm.engine.state)
    "qwen3_next": "hybrid gated delta-net + attention + MoE (Qwen3-Next)",
    "qwen3_5": "hybrid gated delta-net + attention (Qwen3.5)",
    "mamba2": "pure SSM (Mamba2), no KV at all",
    "lfm2": "hybrid short convolution + attention (LFM2)",
    "granitemoehybrid": "hybrid Mamba2 + attention + MoE (Granite 4)",
    "kimi_linear": "hybrid KDA + MLA + MoE (Kimi-Linear)",
    "falcon_h1": "parallel Mamba2 + attention in one layer (a CacheList of state and KV)",
    # recurrent scans that ignore a padded row's length: one row per prefill pass (compat: prefill_alone)
    "mamba": "pure SSM (Mamba 1)",
    "nemotron_h": "hybrid Mamba2 + attention + MLP layers (Nemotron-H)",
    "rwkv7": "RWKV-7 linear attention",
    # several caches per layer
    "longcat_flash": "two MLA attention sublayers per layer (a CacheList of two KV caches)",
}
STATEFUL = {"qwen3_next", "qwen3_5", "mamba2", "lfm2", "granitemoehybrid", "kimi_linear", "falcon_h1", "mamba",
            "nemotron_h", "rwkv7"}


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

    # a prefix hit: the longest prompt's first 24 tokens, then new ones (a model with recurrent
    # state runs without the prefix cache: the state after a prefix is not in its KV blocks)
    follow = prompts[3][:24] + _prompts(2, (6,))[0]
    hits = engine.stats().prefix_hit_tokens
    res = run_all(engine, [req("p", follow, greedy(10))])
    if name in STATEFUL:
        assert engine.stats().prefix_hit_tokens == 0 and engine.config.prefix_cache is False
    else:
        assert engine.stats().prefix_hit_tokens - hits >= 16, name
    assert res[("p", 0)]["tokens"] == reference_greedy(model, follow, 10), f"{name}: after a prefix hit"

    if name in STATEFUL:
        # the state rows may take only half the budget (memory.fit_state_rows), so the KV left is never
        # short here: a high-priority arrival takes one of the two rows instead, preempting a running row
        tight = make_engine(model, max_prefill_tokens=16, block_size=4, max_num_seqs=2, priority_aging_s=0)
        reqs = [req(f"t{i}", p, greedy(24), priority=5) for i, p in enumerate(prompts)]
        res = run_all(tight, reqs[:2], arrivals={6: [reqs[2]], 7: [req("t3", prompts[3], greedy(24), priority=-3)]})
    else:
        # 96 live token slots for four sequences that grow to 27-54 tokens: one is preempted and
        # recomputed (a quarter of 128 holds the prefix cache)
        bpt = engine.runner.live.bytes_per_token
        tight = make_engine(model, max_prefill_tokens=16, block_size=4, kv_budget_bytes=bpt * 128,
                            prefix_pool_fraction=0.25, max_num_seqs=8)
        res = run_all(tight, [req(f"t{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    assert tight.stats().preemptions > 0, name
    for i, p in enumerate(prompts):
        assert res[(f"t{i}", 0)]["tokens"] == reference_greedy(model, p, 24), f"{name}: preempted prompt {i}"


@pytest.mark.parametrize("name, reason", [
    ("deepseek_v41", "LayerCache"),
    ("gpt_bigcode-unadapted", "rows of different lengths"), ("plamo3", "window"),
])
def test_what_cannot_be_served_is_refused_at_load(name, reason):
    model, _ = tiny.build_any(name.removesuffix("-unadapted"))
    if name.endswith("-unadapted"):  # mlx-lm's forward without its family adapter (parallm.engine.families)
        model.model_type = name
    with pytest.raises(UnsupportedModel, match=reason):
        make_engine(model)


def test_a_row_freed_by_abort_starts_the_next_sequence_with_fresh_state():
    model, _ = tiny.build_any("qwen3_next")
    prompts = _prompts(3, (7, 12, 5))
    engine = make_engine(model, max_prefill_tokens=16)
    for i, p in enumerate(prompts[:2]):
        engine.add_request(req(f"a{i}", p, greedy(30)))
    for _ in range(4):
        engine.step()
    assert engine.abort("a0")
    res = run_all(engine, [req("next", prompts[2], greedy(10))])
    assert res[("next", 0)]["tokens"] == reference_greedy(model, prompts[2], 10)
    assert res[("a1", 0)]["tokens"][-5:] == reference_greedy(model, prompts[1], 30)[-5:]


@pytest.mark.parametrize("name", ["cohere2", "deepseek_v3", "deepseek_v2", "gemma3n", "gpt_oss", "llama4", "afm7",
                                  "gemma4_text", "gpt_bigcode"])
def test_long_prompts_chunks_read_in_place_keep_mlx_lm_tokens(name):
    """Prompt chunks attending over the K tiles in place (paged_attention.PrefillRead, where the engine's probe
    lets them): a 120-token prompt in 8-token chunks (spans of 4 chunks and more read in place), a short prompt
    joining its late chunks: the tokens of mlx-lm's own greedy decode."""
    model, _ = tiny.build_any(name)
    long, short = _prompts(3, (120, 5))
    engine = make_engine(model, max_prefill_tokens=8, block_size=4)
    res = run_all(engine, [req("long", long, greedy(6))], arrivals={9: [req("short", short, greedy(6))]})
    assert res[("long", 0)]["tokens"] == reference_greedy(model, long, 6), name
    assert res[("short", 0)]["tokens"] == reference_greedy(model, short, 6), name
