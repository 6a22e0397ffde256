"""Draft-model speculation keeps the target's sampling distribution, under both acceptances of
engine/spec/draft_verify.py: coupled (the default: the draft proposes with the target's own noise, a
proposal is accepted while it is the target's own sample, so the distribution is trivially the target's,
checked all the same) and rejection (accept a draft token x with probability min(1, p(x)/q(x)), else emit
a token of the residual max(0, p - q)): the same chi-square test as tests/test_engine_spec_distribution.py
(joint frequencies of the first three sampled tokens of a 5-token-vocabulary model, 2,000 seeded samples,
top-k 4 at temperature 1, against the exact probabilities), with a random draft of the same vocabulary
whose distributions differ from the target's (so proposals are both accepted and rejected, and under
rejection rejections draw from the residual); the reported logprobs equal the exact ones. Coupled also
emits plain decoding's tokens for every seed (the first 256 samples against a run without speculation).

Power: the same test rejects, with p < 1e-12, a verifier that takes every draft token unchecked, and
with p < 1e-6 one that on rejection samples from p instead of the residual (the classic bug: it
over-weights the draft's tokens). The test's general power is the n-gram test's (~30 degrees of
freedom at n = 2,000: a shift of noncentrality ~40 is detected with probability > 0.9)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from _engine_helpers import COMMON, make_engine, run_all, req
from test_engine_spec_distribution import (PROMPT, REQUESTS, N_PER, TOKENS, TOP_K, V, chi_square_p, exact_joint,
                                           joint_counts, tiny_vocab_model)

from parallm.config import SpecConfig
from parallm.engine.spec import draft_verify
from parallm.protocol import SamplingParams

SPEC = SpecConfig(mode="draft", k=3, min_acceptance=0.0, disable_batch_size=256, draft_acceptance="rejection")
COUPLED = SpecConfig(mode="draft", k=3, min_acceptance=0.0, disable_batch_size=256)


def draft_model():
    mx.random.seed(9)
    model = llama.Model(llama.ModelArgs(model_type="llama", **{**COMMON, "vocab_size": V, "num_hidden_layers": 1}))
    mx.eval(model.parameters())
    return model


def sample(model, draft, spec=SPEC, requests=REQUESTS):
    engine = make_engine(model, max_num_seqs=256, spec=spec, draft=draft)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=TOKENS + 1, ignore_eos=True, seed=20_000 + 89 * r,
                             logprobs=True) for r in range(requests)]
    return run_all(engine, [req(f"r{r}", PROMPT, params[r], n=N_PER) for r in range(requests)]), engine


@pytest.mark.parametrize("spec", [COUPLED, SPEC], ids=["coupled", "rejection"])
def test_sampled_frequencies_with_a_draft_match_the_target_distribution(spec):
    model, draft = tiny_vocab_model(), draft_model()
    joint = exact_joint(model)
    res, engine = sample(model, draft, spec)
    s = engine.stats().spec
    print(spec.draft_acceptance, "acceptance", s.acceptance_rate, "mean accepted", s.mean_accepted_tokens)
    assert s.mode == "draft" and s.rows_verified >= REQUESTS * N_PER // 2 and "2" in s.k_distribution
    assert 0.2 * s.proposed_tokens < s.accepted_tokens < 0.9 * s.proposed_tokens, s  # accepted and rejected
    counts = joint_counts(res)
    assert counts.sum() == REQUESTS * N_PER
    p = chi_square_p(counts.ravel(), joint.ravel())
    print("chi-square p", p)
    assert p > 1e-3, p
    for d in list(res.values())[:200]:  # the reported logprobs are the target's, of the processed distribution
        t0, t1, t2 = d["tokens"][:TOKENS]
        want = [joint[t0].sum(), joint[t0, t1].sum() / joint[t0].sum(), joint[t0, t1, t2] / joint[t0, t1].sum()]
        np.testing.assert_allclose(d["logprobs"][:TOKENS], np.log(want), atol=2e-4)
    if spec is COUPLED:  # and the tokens are plain decoding's for each seed
        requests = 256 // N_PER
        plain = run_all(make_engine(model, max_num_seqs=256),
                        [req(f"r{r}", PROMPT, SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=TOKENS + 1,
                                                             ignore_eos=True, seed=20_000 + 89 * r, logprobs=True),
                             n=N_PER) for r in range(requests)])
        assert plain and all(res[key]["tokens"] == plain[key]["tokens"] for key in plain)


def test_the_chi_square_test_rejects_broken_rejection_sampling(monkeypatch):
    model, draft = tiny_vocab_model(), draft_model()
    joint = exact_joint(model)

    # power: a verifier that takes every draft token unchecked
    real_test = draft_verify._test

    def accept_all(*a):
        got = real_test(*a)
        return [mx.ones_like(got[0]).astype(mx.bool_), *got[1:]]

    monkeypatch.setattr(draft_verify, "_test", accept_all)
    assert chi_square_p(joint_counts(sample(model, draft)[0]).ravel(), joint.ravel()) < 1e-12

    # and one that draws a rejected position's token from p instead of the residual max(0, p - q)
    def from_p(runner, logits, prop, rows, cols, seqs, positions, d_rows):
        got = real_test(runner, logits, prop, rows, cols, seqs, positions, d_rows)
        at = (mx.array(rows, dtype=mx.int32), mx.array(cols, dtype=mx.int32))
        from parallm.engine.sampling import BatchParams, gumbel_noise, noise_key
        z = runner.sampler.process(logits[at], BatchParams(seqs, runner.eos_ids, runner.vocab_size), positions)
        noise = gumbel_noise([noise_key(s.seed ^ 77, q) for s, q in zip(seqs, positions)], runner.vocab_size)
        return [got[0], mx.argmax(z + noise, axis=-1).astype(mx.int32), got[2], got[3]]

    monkeypatch.setattr(draft_verify, "_test", from_p)
    p_bug = chi_square_p(joint_counts(sample(model, draft)[0]).ravel(), joint.ravel())
    print("chi-square p: residual bug", p_bug)
    assert p_bug < 1e-6, p_bug
