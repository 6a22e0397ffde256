"""Speculative decoding keeps the target's sampling distribution (engine/spec/verify.py): on a model with a
5-token vocabulary, the joint frequencies of the first three sampled tokens (125 cells; the second
and third are verified in one pass when the second's proposal is accepted) over 2,000
seeded samples, with spec.mode ngram, against the exact probabilities computed from the model (top-k
4 at temperature 1: the processed distribution), by a chi-square test; the reported logprobs equal the
exact ones; and the same seeds give the same tokens without speculation.

Power: the test pools cells expected below 5 and rejects at p < 0.001. A verifier that took every
proposed token without checking it (the classic bug) is run through the same test and rejected with
p < 1e-12: the prompt repeats (1, 2, 3), so proposals exist from the second token on and accepting them
blindly moves much of the mass. With ~30 degrees of freedom (the cells expected at 5 or more) at
n = 2,000, the test detects with probability > 0.9 any shift whose noncentrality n * sum((q - p)^2 / p)
exceeds ~40: for example 2.5% of the mass moved from one cell of probability 0.1 to another
(n * (0.025^2 / 0.1 + 0.025^2 / 0.1) = 25 from those two alone, ~50 with the renormalization of the rest
folded in is not assumed: 2,000 * 2 * 0.035^2 / 0.1 = 49 for 3.5%).
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from _engine_helpers import COMMON, make_engine, run_all, req

from parallm.config import SpecConfig
from parallm.engine.spec import verify as verify_module
from parallm.protocol import SamplingParams

V = 5
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
TOKENS = 3
TOP_K = 4
REQUESTS, N_PER = 40, 50
# ngram_max 8: the periodic prompt matches 5 tokens back, a long match (control.LONG_MATCH) that proposes k
SPEC = SpecConfig(mode="ngram", k=3, ngram_min=1, ngram_max=8, min_acceptance=0.0, disable_batch_size=256)


def tiny_vocab_model() -> nn.Module:
    mx.random.seed(1)
    model = llama.Model(llama.ModelArgs(model_type="llama", **{**COMMON, "vocab_size": V}))
    mx.eval(model.parameters())
    return model


def processed(logits: mx.array) -> np.ndarray:
    """The sampler's distribution: top-k at temperature 1."""
    z = np.array(logits.astype(mx.float32))
    keep = np.argsort(-z)[:TOP_K]
    p = np.zeros(V)
    p[keep] = np.exp(z[keep] - z[keep].max())
    return p / p.sum()


def exact_joint(model: nn.Module) -> np.ndarray:
    """P(t0, t1, t2) from the model's own logits over every prefix (no cache, no engine)."""
    def next_p(prefix):
        return processed(model(mx.array([PROMPT + prefix]))[0, -1])
    joint = np.zeros((V,) * TOKENS)
    p0 = next_p([])
    for a in range(V):
        p1 = next_p([a])
        for b in range(V):
            joint[a, b] = p0[a] * p1[b] * next_p([a, b])
    return joint


def sample(model: nn.Module, spec: SpecConfig | None):
    engine = make_engine(model, max_num_seqs=256, spec=spec)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=TOKENS + 1, ignore_eos=True, seed=10_000 + 97 * r,
                             logprobs=True) for r in range(REQUESTS)]
    res = run_all(engine, [req(f"r{r}", PROMPT, params[r], n=N_PER) for r in range(REQUESTS)])
    return res, engine


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square, cells expected below 5 pooled (Wilson-Hilferty's normal
    approximation of the chi-square tail, good to ~1e-3 relative at these degrees of freedom)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum() + (obs[~keep].sum() > 0) * 1e9)
    k = int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def joint_counts(res) -> np.ndarray:
    counts = np.zeros((V,) * TOKENS)
    for d in res.values():
        counts[tuple(d["tokens"][:TOKENS])] += 1
    return counts


def test_sampled_frequencies_with_speculation_match_the_target_distribution(monkeypatch):
    model = tiny_vocab_model()
    joint = exact_joint(model)
    assert joint.max() < 0.4 and (joint > 0.01).sum() >= 15  # far from degenerate
    spec_res, engine = sample(model, SPEC)
    s = engine.stats().spec
    assert s.rows_verified >= REQUESTS * N_PER // 2 and s.accepted_tokens > 0.2 * s.proposed_tokens  # it speculated
    assert "2" in s.k_distribution  # two proposed tokens verified at once (positions 1 and 2)
    counts = joint_counts(spec_res)
    assert counts.sum() == REQUESTS * N_PER
    p = chi_square_p(counts.ravel(), joint.ravel())
    assert p > 1e-3, p
    # the reported logprobs are the target's, of the processed distribution
    for d in list(spec_res.values())[:200]:
        t0, t1, t2 = d["tokens"][:TOKENS]
        want = [joint[t0].sum(), joint[t0, t1].sum() / joint[t0].sum(), joint[t0, t1, t2] / joint[t0, t1].sum()]
        np.testing.assert_allclose(d["logprobs"][:TOKENS], np.log(want), atol=2e-4)
    # the same seeds without speculation: the same tokens
    plain, _ = sample(model, None)
    assert {k: v["tokens"] for k, v in plain.items()} == {k: v["tokens"] for k, v in spec_res.items()}

    # power: a verifier that takes every proposed token unchecked fails the same test
    def blind(self, i, draft):
        out = [(self.first, i)]
        for j, _ in enumerate(draft):
            out.append((self.rest, self.starts[i] + j))
        return out

    def proposals_as_tokens(runner, seqs, drafts):
        got = real_verify(runner, seqs, drafts)
        for i, d in enumerate(drafts):  # the "sample" at each position is the proposal itself
            if d:
                got.first.tokens[i] = d[0]
                for j, t in enumerate(d[1:]):
                    got.rest.tokens[got.starts[i] + j] = t
        return got

    real_verify = verify_module.verify
    monkeypatch.setattr(verify_module.Verified, "emitted", blind)
    from parallm.engine.spec import decoder
    monkeypatch.setattr(decoder, "verify", proposals_as_tokens)
    broken, _ = sample(model, SPEC)
    assert chi_square_p(joint_counts(broken).ravel(), joint.ravel()) < 1e-12
