"""The engine on the real default model (SmolLM2-135M, float32): parity with mlx-lm, seeds,
prefix cache, preemption, logprobs."""

import random

import mlx.core as mx
import numpy as np
import pytest

from _default_model import EOS_TOKEN_ID, default_model
from _engine_helpers import greedy, make_engine, reference_greedy, run_all, req

from parallm.protocol import SamplingParams


@pytest.fixture(scope="module")
def model():
    return default_model()


def new(engines, model, **kw):
    kw.setdefault("kv_budget_bytes", 512 << 20)
    kw.setdefault("max_model_len", 2048)
    e = make_engine(model, eos=[EOS_TOKEN_ID], **kw)
    engines.append(e)
    return e


def text_like(n, seed):
    """Token ids drawn from the common part of the vocabulary (ids of frequent words)."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(200, 12000) for _ in range(n - 1)]


PROMPT_LENS = [3, 11, 26, 40, 64, 95, 130, 610]


@pytest.fixture(scope="module")
def greedy_refs(model):
    return [reference_greedy(model, text_like(n, i), 16, prefill_step_size=512) for i, n in enumerate(PROMPT_LENS)]


@pytest.mark.slow  # 62 s with its mlx-lm references: make test's 10-minute budget (clean clone, 2-core CI host)
def test_greedy_batched_equals_mlx_lm_with_staggered_arrivals(engines, model, greedy_refs):
    e = new(engines, model)
    reqs = [req(f"r{i}", text_like(n, i), greedy(16)) for i, n in enumerate(PROMPT_LENS)]
    res = run_all(e, reqs[:4], arrivals={2: reqs[4:6], 5: reqs[6:]})
    for i, ref in enumerate(greedy_refs):
        assert res[(f"r{i}", 0)]["tokens"] == ref, f"prompt {i} ({PROMPT_LENS[i]} tokens)"
    assert max(e.stats().decode_batch_hist) >= 6  # they really decoded together


@pytest.mark.slow  # > 20 s on the 2-core CI host: make test's 10-minute budget
def test_seeded_request_same_alone_and_in_a_batch_of_16(engines, model):
    target = req("t", text_like(30, 100), SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=20,
                                                             ignore_eos=True))
    alone = run_all(new(engines, model), [target])[("t", 0)]["tokens"]
    others = [req(f"o{i}", text_like(10 + 7 * i, 200 + i),
                      SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], top_k=[0, 40][i % 2], seed=i if i % 4 else None,
                                     max_tokens=20 + i % 5, ignore_eos=True)) for i in range(15)]
    target2 = req("t", target.prompt_ids, target.params)
    batch = new(engines, model)
    res = run_all(batch, others[:8] + [target2], arrivals={1: others[8:]})
    assert res[("t", 0)]["tokens"] == alone
    assert max(batch.stats().decode_batch_hist) == 16


@pytest.mark.slow  # 17 s: make test's 10-minute budget (clean clone, 2-core CI host)
def test_shared_200_token_prefix_prefills_only_the_remainder(engines, model):
    prefix = text_like(200, 300)
    a = prefix + text_like(20, 301)[1:]
    b = prefix + text_like(30, 302)[1:]
    cold_b = reference_greedy(model, b, 12)
    e = new(engines, model)
    run_all(e, [req("a", a, greedy(4))])
    before = e.stats().prompt_tokens_computed
    res = run_all(e, [req("b", b, greedy(12))])
    s = e.stats()
    cached = 192  # the 12 full 16-token blocks inside the 200-token prefix
    assert s.prefix_hit_tokens == cached
    assert s.prompt_tokens_computed - before == len(b) - cached  # the last token too: it gives the first logits
    assert res[("b", 0)]["usage"].cached_tokens == cached
    assert res[("b", 0)]["tokens"] == cold_b


@pytest.mark.slow  # 47 s on the 2-core host of 2026-11-30
def test_tiny_kv_budget_preempts_and_outputs_match(engines, model):
    reqs = lambda: [req(f"r{i}", text_like(20 + 9 * i, 400 + i),  # noqa: E731
                            SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=40, ignore_eos=True))
                    for i in range(6)]
    roomy = run_all(new(engines, model), reqs())
    bpt = 46080  # bytes of KV per token of this model (float32)
    tight = new(engines, model, kv_budget_bytes=bpt * 200, prefix_pool_fraction=0.25)
    assert tight.budget.budget_tokens == 192  # 12 blocks: a few rows of ~60 tokens fit, but not once they grow
    res = run_all(tight, reqs())
    assert tight.stats().preemptions > 0
    for key, d in roomy.items():
        assert res[key]["tokens"] == d["tokens"], key
        assert res[key]["finish"] == "length"


def test_logprobs_and_score_match_a_direct_forward(engines, model):
    p = text_like(40, 500)
    e = new(engines, model)
    res = run_all(e, [req("x", p, SamplingParams(temperature=1.0, logprobs=True, top_logprobs=2, prompt_logprobs=0,
                                                     max_tokens=12, seed=5, ignore_eos=True))])
    d = res[("x", 0)]
    ids = p + d["tokens"]
    logits = model(mx.array([ids]))[0]
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert np.allclose(d["logprobs"], [ref[i - 1, ids[i]] for i in range(len(p), len(ids))], atol=1e-4)
    plp, _ = d["prompt_logprobs"]
    assert np.allclose(plp[1:], [ref[i - 1, p[i]] for i in range(1, len(p))], atol=1e-4)
    s = e.score(ids, start=len(p))
    assert np.allclose(s.logprobs, d["logprobs"], atol=1e-4)
    # temperature 0: the chosen token's logprob is the maximum of the processed distribution
    g = run_all(e, [req("g", p, SamplingParams(temperature=0, logprobs=True, top_logprobs=3, max_tokens=5,
                                                   ignore_eos=True))])[("g", 0)]
    for lp, top in zip(g["logprobs"], g["top"]):
        assert lp == max(v for _, v in top)
