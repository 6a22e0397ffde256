"""Engine behaviour through its public API, on tiny random-weight models (fast)."""

import math
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from _engine_helpers import (COMMON, TINY_VOCAB, greedy, reference_greedy, req, run_all, tiny_model,
                             tracked_engine as new)
from parallm.engine import RequestRejected
from parallm.protocol import SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def test_rejects_bad_requests(engines, model):
    e = new(engines, model, max_model_len=64)
    bad = [
        (req("a", [], greedy(4)), "prompt"),
        (req("a", [1, TINY_VOCAB], greedy(4)), "prompt"),
        (req("a", [1, -1], greedy(4)), "prompt"),
        (req("a", [1] * 60, greedy(10)), "max_tokens"),
        (req("a", [1], SamplingParams(temperature=-1)), "temperature"),
        (req("a", [1], SamplingParams(top_p=0)), "top_p"),
        (req("a", [1], SamplingParams(max_tokens=0)), "max_tokens"),
        (req("a", [1], SamplingParams(min_tokens=5, max_tokens=4)), "min_tokens"),
        (req("a", [1], SamplingParams(logit_bias={TINY_VOCAB: 1.0})), "logit_bias"),
        (req("a", [1], SamplingParams(stop_token_ids=[TINY_VOCAB])), "stop_token_ids"),
        (req("a", [1], SamplingParams(top_logprobs=21)), "top_logprobs"),
        (req("a", [1], SamplingParams(temperature=float("nan"))), "temperature"),
        (req("a", [1], greedy(4), n=0), "n"),
    ]
    for request, param in bad:
        with pytest.raises(RequestRejected) as info:
            e.add_request(request)
        assert info.value.param == param, request
    e.add_request(req("dup", [1, 2], greedy(2)))
    with pytest.raises(RequestRejected, match="already in use"):
        e.add_request(req("dup", [1, 2], greedy(2)))
    run_all(e)
    small = new(engines, model, kv_budget_bytes=4096 * 16, max_model_len=10_000)
    with pytest.raises(RequestRejected, match="KV memory"):
        small.add_request(req("big", [1] * 500, greedy(500)))


def test_stop_tokens_eos_min_tokens_and_ignore_eos(engines, model):
    p = prompt(7)
    ref = reference_greedy(model, p, 12)
    stop_at = 4
    tok = ref[stop_at]
    assert tok not in ref[:stop_at], "pick a prompt whose stop token does not occur earlier"
    e = new(engines, model, eos=[tok])
    res = run_all(e, [
        req("eos", p, SamplingParams(temperature=0, max_tokens=12)),
        req("ignore", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        req("stopid", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[tok])),
        req("len", p, SamplingParams(temperature=0, max_tokens=3)),
        req("min", p, SamplingParams(temperature=0, max_tokens=12, min_tokens=stop_at + 2)),
    ])
    assert res[("eos", 0)]["tokens"] == ref[:stop_at + 1] and res[("eos", 0)]["finish"] == "stop"
    assert res[("ignore", 0)]["tokens"] == ref and res[("ignore", 0)]["finish"] == "length"
    assert res[("stopid", 0)]["tokens"] == ref[:stop_at + 1] and res[("stopid", 0)]["finish"] == "stop"
    assert res[("len", 0)]["tokens"] == ref[:3] and res[("len", 0)]["finish"] == "length"
    mins = res[("min", 0)]["tokens"]
    assert tok not in mins[:stop_at + 2] and mins[:stop_at] == ref[:stop_at]
    u = res[("eos", 0)]["usage"]
    assert (u.prompt_tokens, u.completion_tokens) == (7, stop_at + 1)


def test_logprobs_are_the_sampled_distribution_on_a_tiny_vocab(engines):
    mx.random.seed(3)
    small = llama.Model(llama.ModelArgs(model_type="llama", **{**COMMON, "vocab_size": 16}))
    mx.eval(small.parameters())
    e = new(engines, small)
    reqs = [
        req("full", [1, 2, 3], SamplingParams(temperature=0.7, top_logprobs=16, logprobs=True, max_tokens=6, seed=1)),
        req("topk", [1, 2, 3], SamplingParams(temperature=1.3, top_k=5, top_logprobs=16, max_tokens=6, seed=2)),
        req("greedy", [4, 5], SamplingParams(temperature=0, top_logprobs=16, max_tokens=6)),
    ]
    res = run_all(e, reqs)
    for rid, support in (("full", 16), ("topk", 5), ("greedy", 16)):
        d = res[(rid, 0)]
        assert len(d["top"]) == len(d["tokens"]) == 6
        for tok, lp, top in zip(d["tokens"], d["logprobs"], d["top"]):
            probs = [math.exp(v) for _, v in top]
            assert abs(sum(probs) - 1.0) < 1e-5, rid
            assert sum(p > 0 for p in probs) == support, rid
            assert dict(top)[tok] == pytest.approx(lp)
            if rid == "greedy":
                assert lp == max(v for _, v in top)


def test_abort_frees_row_and_blocks_at_once(engines, model):
    e = new(engines, model)
    for i in range(3):
        e.add_request(req(f"r{i}", prompt(40, i), greedy(50)))
    for _ in range(4):
        e.step()
    s = e.stats()
    assert s.running == 3 and s.kv_blocks_used > 0
    assert e.abort("r1")
    s = e.stats()
    assert s.running == 2
    e.check_integrity()
    assert not e.abort("r1") and not e.abort("nope")
    outs = e.step()
    aborted = [o for o in outs if o.rid == "r1"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].token_ids == []
    res = run_all(e)
    assert all(res[(f"r{i}", 0)]["finish"] == "length" for i in (0, 2))
    assert ("r1", 0) not in res
    # a waiting request aborts too
    e.add_request(req("w", prompt(5), greedy(5)))
    assert e.abort("w")
    assert [o.finish_reason for o in e.step()] == ["abort"]
    # a reason outside protocol.FinishReason would make the step's outputs undecodable (issue 30)
    e.add_request(req("x", prompt(5), greedy(5)))
    with pytest.raises(ValueError, match="bogus"):
        e.abort("x", reason="bogus")
    assert "x" in e.request_ids()


def test_n_greater_than_one_prefills_once_and_forks(engines, model):
    p = prompt(30, 5)
    e = new(engines, model)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=77, ignore_eos=True)
    res = run_all(e, [req("n3", p, params, n=3)])
    assert e.stats().prompt_tokens_computed == len(p)  # one prefill for three sequences
    outs = [res[("n3", i)]["tokens"] for i in range(3)]
    assert len({tuple(o) for o in outs}) == 3
    # each fork samples its own seed stream: seed + index, like a separate request with that seed
    for i in range(3):
        single = new(engines, model, prefix_cache=False)
        r = run_all(single, [req("one", p, SamplingParams(temperature=1.0, max_tokens=10, seed=77 + i,
                                                                ignore_eos=True))])
        assert r[("one", 0)]["tokens"] == outs[i]


def test_overlap_and_compile_do_not_change_outputs(engines, model):
    reqs = lambda: [req(f"r{i}", prompt(5 + 9 * i, i), SamplingParams(  # noqa: E731
        temperature=0 if i % 2 else 0.9, top_p=0.9, max_tokens=15, seed=i, ignore_eos=True)) for i in range(5)]
    def tokens(results):  # how the tokens are split over step outputs depends on the passes, cached_tokens on
        # the prefix cache (r4 shares its first token with r3: a partial block hit)
        return {k: {f: (v.prompt_tokens, v.completion_tokens) if f == "usage" else v for f, v in r.items()
                    if f != "outputs"} for k, r in results.items()}

    base = tokens(run_all(new(engines, model), reqs()))
    for kw in ({"overlap": False}, {"compile": False}, {"prefix_cache": False}, {"max_prefill_tokens": 7},
               {"mixed_passes": False}):
        assert tokens(run_all(new(engines, model, **kw), reqs())) == base, kw


def direct_logprobs(model, ids):
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_prompt_logprobs_logprobs_and_score_match_a_direct_forward(engines, model):
    p = prompt(25, 9)
    e = new(engines, model, max_prefill_tokens=8)
    res = run_all(e, [req("x", p, SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3,
                                                     prompt_logprobs=2, max_tokens=10, seed=4, ignore_eos=True))])
    d = res[("x", 0)]
    ids = p + d["tokens"]
    ref = direct_logprobs(model, ids)
    want = [ref[i - 1, ids[i]] for i in range(len(p), len(ids))]
    assert np.allclose(d["logprobs"], want, atol=1e-4)
    plp, ptop = d["prompt_logprobs"]
    assert plp[0] is None and ptop[0] is None and len(plp) == len(p)
    assert np.allclose(plp[1:], [ref[i - 1, p[i]] for i in range(1, len(p))], atol=1e-4)
    for i in range(1, len(p)):
        best = np.argsort(-ref[i - 1])[:2].tolist()
        assert [t for t, _ in ptop[i]] == best
    s = e.score(ids, start=3, top_logprobs=2)
    assert np.allclose(s.logprobs, [ref[i - 1, ids[i]] for i in range(3, len(ids))], atol=1e-4)
    assert [t for t, _ in s.top_logprobs[0]] == np.argsort(-ref[2])[:2].tolist()  # predicts ids[3]
    with pytest.raises(RequestRejected):
        e.score(ids, start=0)


def test_first_tokens_come_from_the_prefill_pass_before_its_decode(engines, model):
    """Every prompt a prefill pass finishes gets its first token from that pass, handed to `emit`
    before the step's decode pass (which then samples the second); a request whose first token
    ends it never reaches a decode pass and leaves nothing behind."""
    e = new(engines, model)
    e.add_request(req("a", prompt(12, 1), greedy(5, logprobs=True, top_logprobs=2)))
    e.add_request(req("n2", prompt(9, 2), SamplingParams(temperature=1.0, seed=5, max_tokens=4), n=2))
    e.add_request(req("one", prompt(7, 3), greedy(1)))
    emitted = []
    returned = e.step(emit=emitted.append)
    assert len(emitted) == 1
    first = {(o.rid, o.index): o for o in emitted[0]}
    assert set(first) == {("a", 0), ("n2", 0), ("n2", 1), ("one", 0)}
    assert all(len(o.token_ids) == 1 for o in first.values())
    assert first[("one", 0)].finish_reason == "length" and first[("one", 0)].usage.completion_tokens == 1
    assert len(first[("a", 0)].logprobs) == 1 and len(first[("a", 0)].top_logprobs[0]) == 2
    second = {(o.rid, o.index): o for o in returned}
    assert set(second) == {("a", 0), ("n2", 0), ("n2", 1)}  # the decode pass of the same step
    assert e.stats().decode_batch_hist == {3: 1}
    e.check_integrity()
    rest = run_all(e)
    tokens = {k: first[k].token_ids + second[k].token_ids + rest[k]["tokens"] for k in second}
    ref = new(engines, model)
    ref.add_request(req("a", prompt(12, 1), greedy(5, logprobs=True, top_logprobs=2)))
    ref.add_request(req("n2", prompt(9, 2), SamplingParams(temperature=1.0, seed=5, max_tokens=4), n=2))
    whole = run_all(ref)  # without emit: the first tokens come back with the step's other outputs
    assert tokens == {k: whole[k]["tokens"] for k in tokens}
    assert e.stats().kv_blocks_used == 0 and not e.has_work()


def test_output_head_projects_only_the_chosen_positions():
    from parallm.engine.head import OutputHead
    from mlx_lm.models.cache import make_prompt_cache

    from _engine_helpers import TINY_MODELS

    tokens = mx.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], dtype=mx.int32)
    rows = mx.array([4, 7], dtype=mx.int32)  # flattened [batch x length] positions
    for name in TINY_MODELS:
        m = tiny_model(name)
        head = OutputHead(m)
        assert head.usable, name
        full = m(tokens, cache=make_prompt_cache(m)).reshape(-1, TINY_VOCAB)
        with head.select(rows):
            picked = m(tokens, cache=make_prompt_cache(m))
        assert picked.shape == (1, 2, TINY_VOCAB)
        assert mx.allclose(picked[0], full[rows], rtol=1e-4, atol=1e-4), name
        assert m(tokens, cache=make_prompt_cache(m)).shape == (2, 5, TINY_VOCAB)  # restored
