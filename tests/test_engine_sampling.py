"""The batched sampler on crafted logits (no model)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from parallm.engine.sampling import BatchParams, PenaltyState, Sampler, gumbel_noise, noise_key
from parallm.engine.sequence import Sequence
from parallm.protocol import SamplingParams

V = 6
EOS = 5


def seqs_for(params_list, seeds=None, outputs=None):
    out = []
    for i, p in enumerate(params_list):
        s = Sequence(seq_id=i, rid=f"r{i}", index=0, prompt_ids=[0, 1], params=p,
                     seed=(seeds[i] if seeds else 1000 + i))
        if outputs:
            s.output_ids = list(outputs[i])
        out.append(s)
    return out


def sample(params_list, logits, positions=None, seeds=None, pen=None):
    seqs = seqs_for(params_list, seeds)
    bp = BatchParams(seqs, [EOS], logits.shape[-1])
    positions = positions or [0] * len(seqs)
    args = (pen.counts[:len(seqs)], pen.seen[:len(seqs)]) if pen is not None else (None, None)
    out = Sampler(logits.shape[-1]).sample(logits, bp, positions, *args)
    return out, bp


LOGITS = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 0.2]])


def softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def test_plain_greedy_is_one_argmax():
    out, bp = sample([SamplingParams(temperature=0)], LOGITS)
    assert bp.plain_greedy and out.tokens.tolist() == [0] and out.logprobs is None


def test_logprob_at_temperature_zero_is_the_max():
    out, _ = sample([SamplingParams(temperature=0, logprobs=True, top_logprobs=V)], LOGITS)
    lp = np.log(softmax(np.array(LOGITS[0])))
    assert out.tokens.tolist() == [0]
    assert abs(out.logprobs.item() - lp.max()) < 1e-6
    tops = dict(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))
    assert abs(sum(math.exp(v) for v in tops.values()) - 1) < 1e-5


def empirical(params, logits, n=4000):
    big = mx.broadcast_to(logits, (n, logits.shape[-1]))
    out, _ = sample([params] * n, big, seeds=list(range(n)))
    return np.bincount(np.array(out.tokens), minlength=logits.shape[-1]) / n, out


@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_softmax(temp):
    freq, _ = empirical(SamplingParams(temperature=temp), LOGITS)
    want = softmax(np.array(LOGITS[0]) / temp)
    assert np.abs(freq - want).max() < 0.03, (freq, want)


def test_filters_define_the_support_and_logprobs_of_the_sampled_distribution():
    l = np.array(LOGITS[0])
    cases = {
        "top_k": (SamplingParams(temperature=1.0, top_k=2, top_logprobs=V), {0, 1}),
        "top_p": (SamplingParams(temperature=1.0, top_p=0.6, top_logprobs=V), None),
        "min_p": (SamplingParams(temperature=1.0, min_p=0.3, top_logprobs=V), None),
    }
    p = softmax(l)
    order = np.argsort(-p)
    nucleus = set(order[:np.searchsorted(np.cumsum(p[order]), 0.6) + 1].tolist())
    cases["top_p"] = (cases["top_p"][0], nucleus)
    cases["min_p"] = (cases["min_p"][0], set(np.nonzero(p >= 0.3 * p.max())[0].tolist()))
    for name, (params, support) in cases.items():
        freq, out = empirical(params, LOGITS, n=3000)
        assert set(np.nonzero(freq)[0].tolist()) == support, name
        want = np.where(np.isin(np.arange(V), list(support)), p, 0)
        want /= want.sum()
        assert np.abs(freq - want).max() < 0.04, name
        tops = dict(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))
        probs = {t: math.exp(v) for t, v in tops.items()}
        assert abs(sum(probs.values()) - 1) < 1e-5, name  # the sampled distribution sums to 1
        for t in range(V):
            assert (probs[t] > 0) == (t in support), name
            assert abs(probs[t] - want[t]) < 1e-5, name


def test_same_seed_same_tokens_whatever_the_batch():
    logits = mx.array(np.random.default_rng(0).standard_normal((16, 50)).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_k=i % 3 * 10, top_p=1.0 if i % 2 else 0.9) for i in range(16)]
    seeds = list(range(100, 116))
    full, _ = sample(params, logits, positions=list(range(16)), seeds=seeds)
    for i in (0, 5, 15):
        alone, _ = sample([params[i]], logits[i:i + 1], positions=[i], seeds=[seeds[i]])
        assert alone.tokens.tolist() == [full.tokens[i].item()]
    again, _ = sample(params, logits, positions=list(range(16)), seeds=seeds)
    assert again.tokens.tolist() == full.tokens.tolist()
    moved, _ = sample(params, logits, positions=list(range(1, 17)), seeds=seeds)
    assert moved.tokens.tolist() != full.tokens.tolist()  # another position, other noise


def test_mixed_greedy_and_sampled_rows():
    logits = mx.broadcast_to(LOGITS, (64, V))
    params = [SamplingParams(temperature=0 if i % 2 else 5.0) for i in range(64)]
    out, bp = sample(params, logits, seeds=list(range(64)))
    toks = out.tokens.tolist()
    assert all(t == 0 for t in toks[1::2])
    assert len(set(toks[0::2])) > 2  # hot rows really sample


def test_gumbel_noise_statistics_and_determinism():
    g = gumbel_noise([noise_key(7, i) for i in range(64)], 4096)
    a = np.array(g)
    assert abs(a.mean() - 0.5772) < 0.01 and abs(a.var() - math.pi ** 2 / 6) < 0.03
    assert np.isfinite(a).all()
    assert mx.array_equal(g[3], gumbel_noise([noise_key(7, 3)], 4096)[0])
    assert np.abs(np.corrcoef(a[0], a[1])[0, 1]) < 0.05


def processed_logprobs(params, logits, outputs, prompt=(0, 1)):
    seqs = seqs_for([params], outputs=[outputs])
    seqs[0].prompt_ids = list(prompt)
    pen = PenaltyState(logits.shape[-1])
    pen.activate(1)
    pen.init_row(0, seqs[0].prompt_ids, seqs[0].output_ids)
    bp = BatchParams(seqs, [EOS], logits.shape[-1])
    out = Sampler(logits.shape[-1]).sample(logits, bp, [len(outputs)], pen.counts[:1], pen.seen[:1])
    return dict(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))


def log_softmax_np(x):
    x = np.asarray(x, dtype=np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def test_penalties_follow_hf_and_openai_semantics():
    l = np.array(LOGITS[0], dtype=np.float64)
    prompt, outputs = (0, 4), [1, 1, 2]
    # repetition (HF, over prompt + output): positive logits divided, negative multiplied
    got = processed_logprobs(SamplingParams(temperature=0, repetition_penalty=2.0, top_logprobs=V), LOGITS, outputs, prompt)
    ref = l.copy()
    for t in set(prompt) | set(outputs):
        ref[t] = ref[t] / 2.0 if ref[t] > 0 else ref[t] * 2.0
    assert np.allclose([got[t] for t in range(V)], log_softmax_np(ref), atol=1e-5)
    # presence/frequency (OpenAI, over output only)
    got = processed_logprobs(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25,
                                            top_logprobs=V), LOGITS, outputs, prompt)
    ref = l.copy()
    for t in set(outputs):
        ref[t] -= 0.5 + 0.25 * outputs.count(t)
    assert np.allclose([got[t] for t in range(V)], log_softmax_np(ref), atol=1e-5)


def test_logit_bias_and_min_tokens_and_stop_ids():
    out, _ = sample([SamplingParams(temperature=0, logit_bias={3: 10.0})], LOGITS)
    assert out.tokens.tolist() == [3]
    eos_logits = mx.array([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], logprobs=True, top_logprobs=V)
    out, _ = sample([p], eos_logits + mx.array([[0, 0, 0, 0, 8.0, 0]]), positions=[1])
    assert out.tokens.tolist() not in ([EOS], [4])  # eos and stop ids masked before min_tokens
    tops = dict(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))
    assert tops[EOS] == -math.inf and tops[4] == -math.inf
    out, _ = sample([p], eos_logits, positions=[2])
    assert out.tokens.tolist() == [EOS]
    ignore = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    out, _ = sample([ignore], eos_logits, positions=[0])
    assert out.tokens.tolist() == [EOS]  # ignore_eos: eos is not a stop token, so not masked


def test_penalty_state_rows_follow_updates_and_copies():
    pen = PenaltyState(8)
    pen.activate(3)
    pen.init_row(0, [1, 2], [3, 3])
    pen.init_row(1, [4], [])
    pen.update(mx.array([3, 4], dtype=mx.int32))
    assert pen.counts[0].tolist() == [0, 0, 0, 3, 0, 0, 0, 0]
    assert pen.seen[1].tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    assert pen.counts[1].tolist()[4] == 1
    pen.copy_rows([(0, 2)])
    pen.resize(4)
    assert pen.counts[2].tolist() == pen.counts[0].tolist() and pen.counts.shape == (4, 8)
