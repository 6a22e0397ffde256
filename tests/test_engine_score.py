"""Teacher-forced scoring as prefill work inside the engine's steps: numbers, batching with other
requests, the prefix cache, abort and preemption, and the engine stage's replies."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
import zmq
from _engine_helpers import TINY_VOCAB, greedy, reference_greedy, req, run_all, tiny_model, tracked_engine as new

from parallm import protocol
from parallm.engine import RequestRejected, ScoreResult, SeqOutput
from parallm.protocol import SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def ids_of(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def direct(model, ids):
    """Logprobs of a plain mlx-lm forward pass (one sequence, its own cache): row i predicts ids[i + 1]."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def want(model, ids, start):
    ref = direct(model, ids)
    return [ref[i - 1, ids[i]] for i in range(start, len(ids))], ref


def scores_of(outputs) -> dict[str, ScoreResult]:
    return {o.qid: o for o in outputs if isinstance(o, ScoreResult)}


@pytest.mark.parametrize("chunk", [8, 512])
def test_scores_equal_a_plain_mlx_lm_forward(engines, model, chunk):
    e = new(engines, model, max_prefill_tokens=chunk)
    ids = ids_of(45, 1)
    for start in (1, 7, 30, 44):
        got = e.score(ids, start=start, top_logprobs=3)
        lps, ref = want(model, ids, start)
        assert got.start == start and got.ids == ids and not got.aborted
        np.testing.assert_allclose(got.logprobs, lps, atol=1e-4)
        assert len(got.top_logprobs) == len(ids) - start
        for i, top in zip(range(start, len(ids)), got.top_logprobs):
            assert [t for t, _ in top] == np.argsort(-ref[i - 1])[:3].tolist()  # best first
            np.testing.assert_allclose([v for _, v in top], np.sort(ref[i - 1])[::-1][:3], atol=1e-4)
    assert e.score(ids, start=5).top_logprobs is None
    assert e.stats().scored_tokens == 44 + 38 + 15 + 1 + 40
    assert not e.has_work()


def test_bad_scores_are_refused(engines, model):
    e = new(engines, model, max_model_len=64)
    for ids, kw, param in (([1], {}, "ids"), ([1, 2, 3], {"start": 0}, "start"), ([1, 2, 3], {"start": 3}, "start"),
                           ([1, TINY_VOCAB], {}, "ids"), ([1] * 65, {}, "ids"), ([1, 2], {"top_logprobs": 21},
                           "top_logprobs"), ([1, 2], {"adapter": "nope"}, "adapter")):
        with pytest.raises(RequestRejected) as info:
            e.add_score("q", ids, **kw)
        assert info.value.param == param, (ids, kw)
    e.add_request(req("r", [1, 2, 3], greedy(4)))
    with pytest.raises(RequestRejected, match="already in use"):
        e.add_score("r", [1, 2, 3])
    run_all(e)
    assert not e.has_work()


def test_scoring_batched_with_running_requests_leaves_their_tokens_unchanged(engines, model, monkeypatch):
    prompts = [ids_of(n, 10 + n) for n in (5, 17, 9, 30)]
    e = new(engines, model, max_prefill_tokens=64)
    passes = []
    prefill = e.runner.prefill

    def recording(work):
        passes.append([s.rid for s in work.seqs])
        return prefill(work)

    monkeypatch.setattr(e.runner, "prefill", recording)
    for i, p in enumerate(prompts[:2]):
        e.add_request(req(f"r{i}", p, greedy(12)))
    outputs = e.step()
    score_ids = [ids_of(20, 3), ids_of(33, 4)]
    e.add_score("s0", score_ids[0], start=4, top_logprobs=2)
    e.add_request(req("r2", prompts[2], greedy(12)))
    e.add_score("s1", score_ids[1], start=1)
    e.add_request(req("r3", prompts[3], greedy(12)))
    tokens: dict[str, list[int]] = {}
    scores = {}
    while True:
        for o in outputs:
            if isinstance(o, SeqOutput):
                tokens.setdefault(o.rid, []).extend(o.token_ids)
        scores.update(scores_of(outputs))
        e.check_integrity()
        if not e.has_work():
            break
        outputs = e.step()
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == reference_greedy(model, p, 12), i
    # scores share prefill passes with prompts
    assert any({r[0] for r in rids} == {"r", "s"} for rids in passes), passes
    for qid, ids, start in (("s0", score_ids[0], 4), ("s1", score_ids[1], 1)):
        np.testing.assert_allclose(scores[qid].logprobs, want(model, ids, start)[0], atol=1e-4)
    assert e.stats().scored_tokens == 16 + 32


def test_a_prefix_hit_is_used_and_gives_the_same_numbers(engines, model):
    prompt = ids_of(70, 5)
    e = new(engines, model, max_prefill_tokens=32, block_size=16)  # the counts below are in 16-token blocks
    gen = run_all(e, [req("g", prompt, greedy(20))])[("g", 0)]["tokens"]
    ids = prompt + gen
    before = e.stats()
    got = e.score(ids, start=len(prompt))
    after = e.stats()
    # the tokens before position start-1 = 69: 4 full blocks of 16, and 5 of the fifth from a copy of the
    # prompt's fifth block (a partial hit; the prompt's blocks were written back)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 69 and after.prefix_partial_hits == 1
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(ids) - 69
    assert after.scored_tokens == 20
    cold = new(engines, model, prefix_cache=False).score(ids, start=len(prompt))
    np.testing.assert_allclose(got.logprobs, cold.logprobs, atol=1e-5)
    np.testing.assert_allclose(got.logprobs, want(model, ids, len(prompt))[0], atol=1e-4)
    # the score wrote its own full blocks back: scoring the same ids again hits those too
    again = e.score(ids, start=len(ids) - 1)
    assert e.stats().prefix_hit_tokens - after.prefix_hit_tokens == 80
    np.testing.assert_allclose(again.logprobs, got.logprobs[-1:], atol=1e-5)


def test_abort_of_a_score_frees_everything(engines, model):
    e = new(engines, model, max_prefill_tokens=8)
    e.add_request(req("r", ids_of(6, 1), greedy(30)))
    e.add_score("s", ids_of(60, 2), start=3)
    e.step()
    e.step()
    assert e.stats().prefilling == 1 and "s" in e.request_ids()
    assert e.abort("s")
    e.check_integrity()
    assert "s" not in e.request_ids() and e.stats().prefilling == 0
    [aborted] = scores_of(e.step()).values()
    assert aborted.qid == "s" and aborted.aborted and aborted.logprobs == []
    e.add_score("w", ids_of(10, 3))  # waiting, never admitted
    assert e.abort("w")
    assert scores_of(e.flush())["w"].aborted
    run_all(e)
    s = e.stats()
    assert s.kv_blocks_used == 0 and s.scored_tokens == 0 and not e.has_work()


def test_preempted_score_is_recomputed_with_the_same_numbers(engines, model):
    """A KV budget that the running rows outgrow while a score is prefilled: the score, admitted
    last, is preempted, and recomputed (partly from the prefix cache) when there is room again."""
    bpt = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x float32
    # 17 blocks of 16: a and b at ~95 tokens hold 12, the score's 60 ids + 16 of headroom take the other 5;
    # a few steps on, a and b need their 7th blocks while the score's chunks still need theirs
    e = new(engines, model, kv_budget_bytes=bpt * 272, max_prefill_tokens=8, max_model_len=400, block_size=16)
    victims = []
    preempt = e.scheduler.preempt

    def recording(seq):
        victims.append(seq.rid)
        preempt(seq)

    e.scheduler.preempt = recording
    for rid in ("a", "b"):
        e.add_request(req(rid, ids_of(10, ord(rid)), greedy(140)))
    while e.stats().generated_tokens < 2 * 85:
        e.step()
    ids = ids_of(60, 8)
    e.add_score("s", ids, start=2, top_logprobs=1)
    scores: dict = {}
    run_all(e, scores=scores)  # checks integrity every step
    assert "s" in victims, victims
    np.testing.assert_allclose(scores["s"].logprobs, want(model, ids, 2)[0], atol=1e-4)
    assert e.stats().kv_blocks_used == 0


def test_engine_score_keeps_other_outputs_for_the_next_step(engines, model):
    p = ids_of(9, 4)
    e = new(engines, model)
    e.add_request(req("r", p, greedy(10)))
    first = e.step()
    e.score(ids_of(40, 5), start=2)  # runs steps: "r" decodes meanwhile
    rest = run_all(e)
    tokens = [t for o in first for t in o.token_ids] + rest[("r", 0)]["tokens"]
    assert tokens == reference_greedy(model, p, 10) and rest[("r", 0)]["finish"] == "length"


def test_the_engine_stage_answers_a_score(engines, model, tmp_path):
    from parallm.stages.engine import EngineStage

    from parallm.config import build_config
    from parallm.runtime import StageRuntime
    from parallm.transport import Receiver, open_socket

    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)}})
    e = new(engines, model)
    ctx = zmq.Context()
    try:
        rt = StageRuntime(config, "engine", ctx=ctx)
        detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
        stage = EngineStage(config, rt, e, {})
        ids = ids_of(30, 9)
        stage.handle(protocol.Score(qid="q1", reply_to=b"c1", ids=protocol.pack_ids(ids), start=5, top_logprobs=2))
        stage.handle(protocol.Score(qid="q2", reply_to=b"c2", ids=protocol.pack_ids([1]), start=1))
        stage.handle(protocol.Score(qid="q3", reply_to=b"c3", ids=protocol.pack_ids(ids), start=5))
        stage.handle(protocol.Submit(rid="r", reply_to=b"c4", prompt_ids=protocol.pack_ids(ids[:7]),
                                     spec=protocol.RequestSpec(params=SamplingParams(max_tokens=3, temperature=0))))
        stage.handle(protocol.Abort(rids=["q3"]))
        while e.has_work():
            stage.send(e.step(emit=stage.send))
        got = {}
        while (message := detok.recv(timeout_ms=200)) is not None:
            if not isinstance(message, (protocol.StepOutputs, protocol.Track)):
                got[message.reply_to] = message
        ok, bad, aborted = got[b"c1"], got[b"c2"], got[b"c3"]
        assert isinstance(ok, protocol.ScoreReply) and ok.qid == "q1"
        lps = protocol.unpack_floats(ok.logprobs)
        np.testing.assert_allclose(lps, want(model, ids, 5)[0], atol=1e-4)
        top = protocol.unpack_top(ok.top_ids, ok.top_logprobs, len(lps))
        assert [len(row) for row in top] == [2] * len(lps) and all(row[0][1] >= row[1][1] for row in top)
        assert isinstance(bad, protocol.RequestError) and (bad.rid, bad.status, bad.param) == ("q2", 400, "ids")
        assert isinstance(aborted, protocol.RequestError) and (aborted.rid, aborted.code) == ("q3", "aborted")
        assert stage.scores == {} and stage.stats().scored_tokens == 25
    finally:
        ctx.destroy(0)
