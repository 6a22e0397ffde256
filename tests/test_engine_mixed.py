"""Mixed passes: prompt chunks prefilled in the decode pass of the running rows (one packed pass)."""

import random

import numpy as np
import pytest

from _engine_helpers import TINY_VOCAB, greedy, make_engine, reference_greedy, run_all, tiny_model, req
from parallm.engine import Request
from parallm.engine.packed import PackedContext
from parallm.protocol import SamplingParams


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def workload() -> tuple[list[Request], dict[int, list[Request]]]:
    """Three requests decoding, then arrivals while they run: prompts of different lengths
    prefilled together (a packed pass with unequal chunks), a long prompt taking several chunks,
    and every sampling feature the decode rows and the first tokens use."""
    first = [req("a", prompt(6, 1), greedy(14, logprobs=True, top_logprobs=3)),
             req("b", prompt(9, 2), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, seed=5,
                                                       ignore_eos=True, logprobs=True)),
             req("c", prompt(4, 3), greedy(3))]  # finishes while later prompts are prefilled
    arrivals = {
        2: [req("d", prompt(3, 4), greedy(8, logprobs=True)),
            req("e", prompt(11, 5), SamplingParams(temperature=1.0, top_k=20, max_tokens=6, seed=9,
                                                       ignore_eos=True)),
            req("f", prompt(7, 6), greedy(1))],  # done by its first token
        4: [req("g", prompt(40, 7), greedy(6, presence_penalty=0.7, repetition_penalty=1.3,
                                              logit_bias={"5": 3.0, "17": -100.0})),
            req("h", prompt(5, 8), SamplingParams(temperature=0.7, max_tokens=7, seed=3, ignore_eos=True),
                    n=2)],
    }
    return first, arrivals


@pytest.mark.parametrize("name,fast_math", [(n, True) for n in ("llama", "qwen3", "llama-sliding", "gemma3_text", "phi3")]
                         + [(n, False) for n in ("llama", "llama-sliding", "phi3")])
def test_mixed_passes_give_the_tokens_and_logprobs_of_separate_passes(name, fast_math):
    """With fast math (the CPU) and without it (a GPU: the stock kernels, packed attention one
    segment at a time, RoPE at each token's own position)."""
    model = tiny_model(name)
    results, mixed = {}, {}
    for on in (True, False):
        engine = make_engine(model, mixed_passes=on, max_prefill_tokens=24, fast_math=fast_math)
        first, arrivals = workload()
        results[on] = run_all(engine, first, arrivals=arrivals)
        mixed[on] = engine.stats().mixed_passes
        assert engine.stats().kv_blocks_used == 0
    assert mixed[True] >= 3 and mixed[False] == 0
    assert results[True].keys() == results[False].keys()
    for key, want in results[False].items():
        got = results[True][key]
        assert got["tokens"] == want["tokens"], (name, key)
        assert got["finish"] == want["finish"] and got["usage"] == want["usage"], (name, key)
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=1e-4, atol=1e-5)
        assert [[t for t, _ in top] for top in got["top"]] == [[t for t, _ in top] for top in want["top"]]


def test_mixed_passes_keep_mlx_lm_greedy_tokens():
    model = tiny_model("llama")
    prompts = [prompt(n, 10 + n) for n in (5, 2, 13, 8, 21)]
    engine = make_engine(model, max_prefill_tokens=10)
    reqs = [req(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    res = run_all(engine, reqs[:2], arrivals={1: reqs[2:4], 3: reqs[4:]})
    assert engine.stats().mixed_passes >= 3
    for i, p in enumerate(prompts):
        assert res[(f"r{i}", 0)]["tokens"] == reference_greedy(model, p, 10), i


def test_prompt_logprobs_take_a_separate_prefill_pass():
    model = tiny_model("llama")
    engine = make_engine(model)
    late = req("late", prompt(9, 2), greedy(4, prompt_logprobs=2))
    res = run_all(engine, [req("early", prompt(5, 1), greedy(8))], arrivals={2: [late]})
    assert engine.stats().mixed_passes == 0
    alone = run_all(make_engine(model), [req("late", prompt(9, 2), greedy(4, prompt_logprobs=2))])
    assert res[("late", 0)]["tokens"] == alone[("late", 0)]["tokens"]
    got, want = res[("late", 0)]["prompt_logprobs"], alone[("late", 0)]["prompt_logprobs"]
    assert len(got[0]) == len(want[0]) == 9 and got[0][0] is None and want[0][0] is None  # the first has no logprob
    np.testing.assert_allclose(got[0][1:], want[0][1:], rtol=1e-5, atol=1e-6)


def test_a_packed_layout_the_model_does_not_follow_turns_mixing_off(monkeypatch):
    """The runner compares one packed pass with separate passes before it mixes; a layout that
    gives other logits (here: the prefill rows' attention reads the decode rows' keys) is refused,
    and the engine keeps giving mlx-lm's tokens from separate passes."""
    original = PackedContext.attend

    def wrong(self, queries, keys, values, *args):
        return original(self, queries, keys[::-1], values[::-1], *args)

    monkeypatch.setattr(PackedContext, "attend", wrong)
    model = tiny_model("llama")
    engine = make_engine(model)
    assert not engine.runner.can_pack
    p, q = prompt(6, 1), prompt(10, 2)
    res = run_all(engine, [req("p", p, greedy(6))], arrivals={2: [req("q", q, greedy(6))]})
    assert engine.stats().mixed_passes == 0
    assert res[("p", 0)]["tokens"] == reference_greedy(model, p, 6)
    assert res[("q", 0)]["tokens"] == reference_greedy(model, q, 6)


def test_half_precision_mixes_with_the_stock_kernels():
    """A bfloat16 model (what a GPU serves) without fast math: packed passes, mlx-lm's greedy tokens."""
    import mlx.core as mx

    model = tiny_model("llama3-rope")
    model.set_dtype(mx.bfloat16)
    prompts = [prompt(n, 20 + n) for n in (5, 2, 13, 8)]
    engine = make_engine(model, max_prefill_tokens=10, fast_math=False)
    assert engine.runner.can_pack and engine.runner.fast_math is None
    reqs = [req(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
    res = run_all(engine, reqs[:2], arrivals={1: reqs[2:3], 3: reqs[3:]})
    assert engine.stats().mixed_passes >= 2
    for i, p in enumerate(prompts):
        assert res[(f"r{i}", 0)]["tokens"] == reference_greedy(model, p, 8), i


def test_a_short_prompt_beside_a_long_prompts_late_chunk_attends_over_its_own_keys(monkeypatch):
    """Issue 30's canary: a short prompt prefilled in the pass of a long prompt's late chunk is
    attended as a group of its own (paged_attention.PrefillRead, K read in place), not over the long
    prompt's span; every request keeps mlx-lm's greedy tokens."""
    from parallm.engine import packed

    groups: list[int] = []

    class Recorded(packed.PrefillRead):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            groups.append(len(self.groups))

    monkeypatch.setattr(packed, "PrefillRead", Recorded)
    model = tiny_model("llama")
    prompts = {"decoding": prompt(4, 30), "long": prompt(150, 31), "short": prompt(3, 32), "short2": prompt(5, 33)}
    engine = make_engine(model, max_prefill_tokens=24, block_size=16)
    reqs = {name: req(name, p, greedy(40 if name == "decoding" else 6)) for name, p in prompts.items()}
    res = run_all(engine, [reqs["decoding"], reqs["long"]], arrivals={4: [reqs["short"]], 5: [reqs["short2"]]})
    assert engine.stats().mixed_passes >= 4
    assert max(groups) == 2, groups
    for name, p in prompts.items():
        assert res[(name, 0)]["tokens"] == reference_greedy(model, p, 40 if name == "decoding" else 6), name


def test_cudas_unfused_defaults_mix_with_each_segment_attended_as_its_separate_pass(monkeypatch):
    """A bfloat16 model under CUDA's attention defaults (unfused short prefills and masked decode): each
    segment of a packed pass attends as the separate pass it stands for (fastmath._segment_sdpa), so the
    runner's check lets packing on and the tokens are the separate passes'. With the stock kernel for every
    segment, the check saw the fused kernel's rounding against the unfused reference's and refused packing
    (0.16-0.18 apart on an H200)."""
    import mlx.core as mx

    from parallm.engine import fastmath

    model = tiny_model("llama3-rope")
    model.set_dtype(mx.bfloat16)
    prompts = [prompt(n, 40 + n) for n in (5, 2, 13, 8)]
    cuda = dict(fast_math=False, unfused_prefill_keys=4096, unfused_decode=True, max_prefill_tokens=10)
    calls: list[bool] = []
    real = fastmath.unfused_sdpa
    monkeypatch.setattr(fastmath, "unfused_sdpa", lambda q, *a: (calls.append(True), real(q, *a))[1])
    results = {}
    for mixed in (False, True):
        engine = make_engine(model, mixed_passes=mixed, **cuda)
        assert engine.runner.can_pack
        reqs = [req(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
        calls.clear()
        results[mixed] = run_all(engine, reqs[:2], arrivals={1: reqs[2:3], 3: reqs[3:]})
        assert (engine.stats().mixed_passes >= 2) == mixed
        assert calls
    for i, p in enumerate(prompts):
        assert results[True][(f"r{i}", 0)]["tokens"] == results[False][(f"r{i}", 0)]["tokens"] \
            == reference_greedy(model, p, 8), i


def test_a_packed_passs_segments_take_the_attention_of_their_separate_passes(monkeypatch):
    """fastmath.packed_sdpa hands PackedContext.attend the separate passes' rule: a masked decode segment
    and a short prefill segment attend unfused under CUDA's defaults, and with the stock kernel without
    them. Before, every segment took the stock kernel whatever the settings."""
    import types

    import mlx.core as mx

    from parallm.engine import fastmath
    from parallm.engine.packed import PackedMask

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(fastmath, "unfused_sdpa", lambda q, k, v, scale, mask: calls.append(("unfused", q.shape[2])) or q)
    monkeypatch.setattr(fastmath, "stock_sdpa",
                        lambda q, k, v, cache, scale, mask, sinks=None: calls.append(("stock", q.shape[2])) or q)

    def attend(queries, keys, values, scale, window, sdpa):  # a decode segment of 2 rows, then a prefill of 2 x 5
        sdpa(mx.zeros((2, 4, 1, 8)), mx.zeros((2, 4, 9, 8)), mx.zeros((2, 4, 9, 8)), None, scale, mx.zeros((2, 1, 1, 9)))
        sdpa(mx.zeros((2, 4, 5, 8)), mx.zeros((2, 4, 12, 8)), mx.zeros((2, 4, 12, 8)), None, scale, mx.zeros((2, 1, 5, 12)))
        return queries

    cache = types.SimpleNamespace(packed=types.SimpleNamespace(attend=attend))
    q = mx.zeros((1, 4, 12, 8))
    fastmath.packed_sdpa(q, q, q, cache, 1.0, PackedMask(None), unfused_keys=4096, unfused_decode=True)
    assert calls == [("unfused", 1), ("unfused", 5)]
    calls.clear()
    fastmath.packed_sdpa(q, q, q, cache, 1.0, PackedMask(None), unfused_keys=8, unfused_decode=False)
    assert calls == [("stock", 1), ("stock", 5)]  # a span of 12 past the 8 keys unfused, decode left fused
