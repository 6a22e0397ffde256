"""Speculative decoding (engine/spec): the n-gram proposer, the per-row control of k, and the engine with
spec.mode ngram emitting exactly what it emits without speculation (greedy and seeded sampling, logprobs,
penalty rows beside speculating ones, adapters, n > 1, preemption), batched with staggered arrivals."""

import numpy as np
import pytest

from _adapter_helpers import adapter_tensors, lora_model
from _engine_helpers import greedy, make_engine, run_all, req, tiny_model, wide_heads_model

from parallm.adapters import save_bytes
from parallm.config import KVConfig, SpecConfig
from parallm.engine.spec.control import SpecControl
from parallm.engine.spec.ngram import ALIGN_WINDOW, Match, NGramProposer, continuation
from parallm.engine.sequence import Sequence
from parallm.protocol import SamplingParams

NGRAM = SpecConfig(mode="ngram", k=4, ngram_min=1, ngram_max=3, disable_batch_size=8)
DEFAULTS = SpecConfig(mode="ngram", disable_batch_size=8)  # k 7 (passes of 8 tokens), n-grams 2..16


# ---------------------------------------------------------------------------------------------- proposer
def test_ngram_proposes_what_followed_the_longest_earlier_match_the_first_of_equals():
    p = NGramProposer(1, 3)
    assert p.propose(0, [1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    # (9, 2, 3) is not there, (2, 3) is twice: what followed its first occurrence wins (vLLM's rule)
    assert p.propose(1, [2, 3, 7, 2, 3, 8, 9, 2, 3], 2) == [7, 2]
    # the occurrence whose match extends furthest back wins over an earlier and a later shorter one
    assert p.propose(4, [9, 3, 1, 5, 3, 2, 5, 3, 3, 9, 5, 3], 2) == [2, 5]
    assert NGramProposer(1, 1).propose(4, [9, 3, 1, 5, 3, 2, 5, 3, 3, 9, 5, 3], 2) == [1, 5]  # 1 token: the first
    assert p.propose(2, [5, 6, 7, 8], 3) == []  # the suffix never matches itself
    assert p.propose(3, [1, 2, 3], 0) == []


def test_ngram_index_grows_with_the_sequence_and_repeats_a_period():
    p = NGramProposer(2, 4)
    toks = [10, 11, 12, 13]
    assert p.propose(7, toks, 4) == []
    toks += [10, 11]
    assert p.propose(7, toks, 4) == [12, 13, 10, 11]
    assert p.propose(8, [7, 7, 7, 7], 3) == [7, 7, 7]  # a match just before the end continues periodically
    assert p.propose(9, [1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]
    p.forget(7)
    assert 7 not in p.keys()
    with pytest.raises(ValueError):
        NGramProposer(3, 2)


def test_ngram_resumes_at_the_copy_position_after_an_accepted_run():
    # a copy with an edit: the prompt's 1 2 3 4 5 6 7 8 9 is being copied, the row wrote 50 where 4 was
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41, 5, 42, 43, 5, 44]
    p = NGramProposer(2, 16)
    toks = prompt + [1, 2, 3]
    m = p.lookup(0, toks)
    assert m == Match(3, 3, False) and continuation(toks, m, 3) == [4, 5, 6]
    p.accepted(0, m, 0)  # nothing accepted: no copy position
    toks += [50, 5]  # the row replaced 4 by 50 and copies on
    assert p.lookup(0, toks) is None  # without a copy position only n_min-grams match: (50, 5) never occurred
    p = NGramProposer(2, 16)
    toks = prompt + [1, 2, 3]
    p.accepted(0, p.lookup(0, toks), 1)  # 4 was accepted (and the row emitted a token after it)
    toks += [4, 50]
    assert p.lookup(0, toks) is None  # (4, 50) never occurred and 50 occurs nowhere near the copy position
    toks += [6]
    m = p.lookup(0, toks)  # 6 occurs right at the copy position (5, after 1 2 3 4 and the replaced token)
    assert m == Match(6, 1, True) and continuation(toks, m, 3) == [7, 8, 9]
    p.accepted(0, m, 2)
    toks += [7, 8, 9]
    m = p.lookup(0, toks)
    assert m.aligned and m.at == 9 and m.n >= 3  # the copy position moved past the accepted 7 8 and the 9 after
    base = [1, 2] + [60 + i for i in range(ALIGN_WINDOW + 4)] + [1, 2]
    p = NGramProposer(2, 16)
    p.accepted(0, p.lookup(0, base), 1)  # 60 accepted: copy position 4 (after 60 and the token after it)
    assert p.lookup(0, base + [60, 99, 60 + ALIGN_WINDOW + 1]).aligned  # ALIGN_WINDOW past it: aligned
    assert p.lookup(0, base + [60, 99, 60 + ALIGN_WINDOW + 2]) is None  # one further: not


def test_ngram_k_sizes_proposals_by_their_match():
    c = SpecControl(k=7, min_acceptance=0.3, multiple=4)
    assert c.ngram_k(7, 1, True) == 7  # aligned: the most, even a one-token match
    assert c.ngram_k(0, 1, True) == 7  # ... and while the row rests
    assert c.ngram_k(None, 9, True) == 0  # a row that may not speculate (penalties, grammar) never does
    assert c.ngram_k(7, 4, False) == 7  # a long unanchored match: the most
    assert c.ngram_k(7, 3, False) == 1  # a short one: a probe of one token (a pass of 2)
    assert c.ngram_k(0, 9, False) == 0  # unanchored matches wait out a rest
    for _ in range(3):
        c.record(1, 7, 0, adapt=False)  # aligned verifies move no rate: the row does not rest
    assert c.k(1) == 7 and c.stats()["proposed_tokens"] == 21
    c.record(1, 1, 0)
    c.record(1, 1, 0)
    assert c.k(1) == 0  # unanchored rejections do


# ---------------------------------------------------------------------------------------------- control
def test_control_raises_k_on_full_acceptance_cuts_it_on_rejection_and_rests_poor_rows():
    c = SpecControl(k=4, min_acceptance=0.3)
    assert c.k(1) == 4
    c.record(1, 4, 1)
    assert c.k(1) == 2  # accepted 1: k = 1 + 1
    c.record(1, 2, 2)
    assert c.k(1) == 3  # all accepted: k + 1
    for _ in range(2):
        c.record(1, 3, 0)
    rests = [c.k(1) for _ in range(3)]
    assert rests[:2] == [0, 0] and rests[2] == 1  # rested 2 steps, back with k = accepted + 1
    c.record(1, 1, 0)
    assert [c.k(1) for _ in range(5)] == [0, 0, 0, 0, 1]  # the next rest is twice as long
    s = c.stats()
    assert s["proposed_tokens"] == 4 + 2 + 6 + 1 and s["accepted_tokens"] == 3
    assert s["emitted_tokens"] == 3 + 5 and s["k_distribution"] == {"1": 1, "2": 1, "3": 2, "4": 1}
    assert s["acceptance_rate"] == pytest.approx(3 / 13) and s["mean_accepted_tokens"] == pytest.approx(3 / 5)


def test_control_keeps_verify_lengths_whole_multiples():
    c = SpecControl(k=8, min_acceptance=0.0, multiple=4)
    assert c.k(1) == 7  # spec.k 8 rounded down to a pass of 8
    c.record(1, 7, 1)
    assert c.k(1) == 3  # accepted 1: k 2 rounded up to a pass of 4
    c.record(1, 3, 3)
    assert c.k(1) == 7  # all accepted: k 4 rounded up to a pass of 8, no further than spec.k
    c.record(1, 7, 7)
    assert c.k(1) == 7
    c.record(1, 7, 4)
    assert c.k(1) == 7  # accepted 4: 5 rounds up to 7
    assert SpecControl(k=2, min_acceptance=0.0, multiple=4).k(1) == 2  # no whole length under spec.k: spec.k
    assert SpecControl(k=5, min_acceptance=0.0, multiple=1).k(1) == 5


# ---------------------------------------------------------------------------------------------- engine
def repetitive(n: int, seed: int, vocab: int = 101) -> list[int]:
    """A prompt that repeats a short random phrase (what prompt lookup finds), with a varied head."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(1, vocab, size=int(rng.integers(3, 7))).tolist()
    head = rng.integers(1, vocab, size=int(rng.integers(1, 5))).tolist()
    return (head + phrase * n)[:6 * n]


def default_model_workload() -> tuple[list, dict[int, list]]:
    """Four greedy requests with logprobs in the default model's vocabulary, whose prompts repeat a
    phrase (what a proposer finds): two at once, one arriving at step 2 and one at step 5 (run_all's
    requests and arrivals; new objects each call)."""
    rng = np.random.default_rng(5)
    phrases = [rng.integers(200, 12000, size=int(rng.integers(4, 9))).tolist() for _ in range(5)]
    made = [req(f"r{i}", [1] + (phrases[i] * 4) + phrases[(i + 1) % 5], greedy(12 + 4 * i, logprobs=True))
            for i in range(4)]
    return made[:2], {2: made[2:3], 5: made[3:]}


def default_model_settings() -> dict:
    """make_engine's settings for default_model_workload on the default model."""
    from _default_model import EOS_TOKEN_ID

    return dict(eos=[EOS_TOKEN_ID], kv_budget_bytes=256 << 20, max_model_len=1024, max_num_seqs=8)


def adapter_rows() -> list:
    """Four greedy requests with logprobs on repetitive prompts, every other one under adapter "a"."""
    return [req(f"r{i}", repetitive(4, 20 + i), greedy(30, logprobs=True), adapter="a" if i % 2 else "")
            for i in range(4)]


def both(model_fn, requests_fn, *, spec=NGRAM, **kw):
    """The results without and with speculation (fresh engines over the same model and fresh requests from
    `requests_fn() -> (requests, arrivals)`), and the speculating engine."""
    model = model_fn()
    reqs, arrivals = requests_fn()
    plain = run_all(make_engine(model, **kw), reqs, arrivals=arrivals)
    engine = make_engine(model, spec=spec, **kw)
    reqs, arrivals = requests_fn()
    return plain, run_all(engine, reqs, arrivals=arrivals), engine


def staggered(params_of, n: int = 6):
    """n requests with repetitive prompts: two at once, two at step 1, the rest at step 4."""
    def make():
        reqs = [req(f"r{i}", repetitive(3 + i, i), params_of(i)) for i in range(n)]
        return reqs[:2], {1: reqs[2:4], 4: reqs[4:]}
    return make


@pytest.mark.parametrize("arch", ["llama", "llama3-rope", "llama-sliding", "qwen3", "gemma2", "gemma3_text", "phi3"])
def test_greedy_tokens_and_logprobs_identical_with_and_without_speculation(arch):
    plain, spec, engine = both(lambda: tiny_model(arch), staggered(lambda i: greedy(24 + 3 * i, logprobs=i % 2 == 0)),
                               max_num_seqs=8)
    assert spec.keys() == plain.keys()
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
        assert spec[key]["finish"] == plain[key]["finish"] == "length"
        np.testing.assert_allclose(spec[key]["logprobs"], plain[key]["logprobs"], atol=1e-4)
    s = engine.stats().spec
    assert s.verify_passes > 0 and s.accepted_tokens > 0, s  # it did speculate, and proposals were accepted
    assert s.emitted_tokens == s.accepted_tokens + s.rows_verified


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_default_settings_verify_whole_multiples_and_stay_exact(arch):
    plain, spec, engine = both(lambda: tiny_model(arch), staggered(lambda i: greedy(24 + 3 * i, logprobs=True)),
                               spec=DEFAULTS, max_num_seqs=8)
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
        np.testing.assert_allclose(spec[key]["logprobs"], plain[key]["logprobs"], atol=1e-4)
    ks = engine.stats().spec.k_distribution
    assert "7" in ks, ks  # rows proposed 7 tokens: verify passes of 8
    sized = sum(n for k, n in ks.items() if k in ("1", "7"))  # k_top, or a one-token probe of a short match
    assert sized >= 0.8 * sum(ks.values()), ks  # other lengths only where max_tokens cut a proposal short


def sampled(i: int) -> SamplingParams:
    kinds = [dict(temperature=0.9), dict(temperature=0.7, top_p=0.9), dict(temperature=1.2, top_k=8),
             dict(temperature=0.8, min_p=0.1, logit_bias={"3": 2.0}), dict(temperature=1.0, min_tokens=10),
             dict(temperature=0.0)]
    return SamplingParams(max_tokens=30, seed=100 + i, ignore_eos=i != 4, stop_token_ids=[5] if i == 4 else [],
                          logprobs=True, top_logprobs=2, **kinds[i % len(kinds)])


def test_seeded_sampling_gives_the_same_tokens_and_logprobs_with_speculation():
    plain, spec, engine = both(lambda: tiny_model("llama", seed=3), staggered(sampled), max_num_seqs=8)
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
        assert spec[key]["finish"] == plain[key]["finish"]
        np.testing.assert_allclose(spec[key]["logprobs"], plain[key]["logprobs"], atol=1e-4)
        assert [[t for t, _ in top] for top in spec[key]["top"]] == [[t for t, _ in top] for top in plain[key]["top"]]
    assert engine.stats().spec.accepted_tokens > 0


def test_penalty_rows_decode_beside_speculating_rows_and_never_speculate():
    def params(i):
        return SamplingParams(max_tokens=25, seed=i, temperature=0.8, ignore_eos=True,
                              **(dict(repetition_penalty=1.3, frequency_penalty=0.5) if i % 2 else {}))
    plain, spec, engine = both(lambda: tiny_model("qwen2"), staggered(params), max_num_seqs=8)
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
    assert engine.stats().spec.verify_passes > 0
    row = Sequence(seq_id=0, rid="x", index=0, prompt_ids=[1], params=params(1), seed=0)
    assert not engine.spec.may_speculate(row) and engine.spec.may_speculate(Sequence(0, "y", 0, [1], params(0), 0))


def test_n_samples_and_preemption_under_speculation():
    def reqs():
        return [req(f"r{i}", repetitive(4 + i, 10 + i), SamplingParams(max_tokens=40, temperature=0.9, seed=i,
                                                                      ignore_eos=True), n=3) for i in range(4)], None
    # a KV budget this small preempts rows (and recomputes them) while the others speculate
    plain, spec, engine = both(lambda: tiny_model("llama"), reqs, max_num_seqs=12, kv_budget_bytes=160 << 10)
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.spec.accepted_tokens > 0


def test_adapter_rows_verify_under_their_adapter():
    def build():
        return tiny_model("llama")

    def engine_with(spec):
        engine = make_engine(build(), max_num_seqs=8, spec=spec)
        ref = build()
        config = lora_model(ref, rank=4, seed=2)
        engine.load_adapter("a", config=config, weights=save_bytes(adapter_tensors(ref)))
        return engine

    plain = run_all(engine_with(None), adapter_rows())
    engine = engine_with(NGRAM)
    spec = run_all(engine, adapter_rows())
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
        np.testing.assert_allclose(spec[key]["logprobs"], plain[key]["logprobs"], atol=1e-4)
    assert engine.stats().spec.accepted_tokens > 0


def test_no_speculation_above_the_disable_batch_size():
    spec = SpecConfig(mode="ngram", ngram_min=1, disable_batch_size=2)
    plain, res, engine = both(lambda: tiny_model("llama"),
                              lambda: ([req(f"r{i}", repetitive(4, i), greedy(12)) for i in range(4)], None),
                              spec=spec, max_num_seqs=8)
    assert res == plain
    s = engine.stats().spec
    assert s.steps_off_batch > 0


def test_stop_tokens_and_max_tokens_end_a_row_inside_an_accepted_run():
    model = tiny_model("llama")
    prompt = repetitive(6, 4)
    ref = run_all(make_engine(model), [req("a", prompt, greedy(30))])[("a", 0)]["tokens"]
    stop = ref[12]
    for params in (greedy(13), greedy(30, stop_token_ids=[stop]), greedy(7)):
        plain = run_all(make_engine(model), [req("a", prompt, params)])
        spec = run_all(make_engine(model, spec=NGRAM), [req("a", prompt, params)])
        assert spec == plain


@pytest.mark.slow  # the default model's verify passes: minutes on a loaded 2-core machine
def test_default_model_greedy_identical_with_speculation_batched_with_staggered_arrivals():
    from _default_model import default_model

    model = default_model()
    kw = default_model_settings()
    made, arrivals = default_model_workload()
    plain = run_all(make_engine(model, **kw), made, arrivals=arrivals)
    engine = make_engine(model, spec=DEFAULTS, **kw)
    made, arrivals = default_model_workload()
    spec = run_all(engine, made, arrivals=arrivals)
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
        np.testing.assert_allclose(spec[key]["logprobs"], plain[key]["logprobs"], atol=2e-3)
    assert engine.stats().spec.accepted_tokens > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_speculation_over_quantized_kv_gives_the_same_tokens(bits):
    """A verify pass writes k + 1 positions per row into the quantized rows (kv.bits) and a rollback
    shrinks them, as with full-precision K/V: the tokens equal the same engine's without speculation."""
    plain, spec, engine = both(lambda: wide_heads_model("llama"), staggered(lambda i: greedy(20 + 2 * i)),
                               max_num_seqs=8, kv=KVConfig(bits=bits, group_size=32))
    assert {k: v["tokens"] for k, v in spec.items()} == {k: v["tokens"] for k, v in plain.items()}
    assert engine.stats().spec.accepted_tokens > 0
