"""Speculative decoding with a draft model (spec.mode draft, engine/spec/draft*.py): greedy tokens and
logprobs identical with and without it (a random tiny draft, low acceptance; the target as its own
draft, full acceptance; a draft whose logits are wider than the target's), batched with staggered
arrivals, n > 1 with preemption, an abort mid-speculation, adapters (the draft runs base); sampled rows
under coupled acceptance (the default): the tokens, logprobs and top alternatives of plain decoding for
the same seeds, whatever the batch and whether a step speculated; under rejection: the target's logprobs
of other tokens; the draft's KV rows follow the target's; the vocabulary check of parallm.models.draft.
The sampled distribution: tests/test_engine_spec_draft_distribution.py."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from _adapter_helpers import adapter_tensors, lora_model
from _engine_helpers import COMMON, greedy, make_engine, run_all, req, tiny_model

from parallm.adapters import save_bytes
from parallm.config import SpecConfig
from parallm.engine.sampling import log_softmax
from parallm.models.draft import vocabulary_mismatch
from parallm.protocol import SamplingParams
from test_engine_spec import adapter_rows, repetitive, staggered

DRAFT = SpecConfig(mode="draft", k=4, disable_batch_size=8, min_acceptance=0.0)  # draft_acceptance coupled
REJECTION = SpecConfig(mode="draft", k=4, disable_batch_size=8, min_acceptance=0.0, draft_acceptance="rejection")


def tiny_draft(seed: int = 7, vocab: int = COMMON["vocab_size"]):
    """A 1-layer llama with random weights: it shares the tiny models' vocabulary (ids), not their weights."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", **{**COMMON, "num_hidden_layers": 1, "hidden_size": 32,
                                                                "vocab_size": vocab}))
    mx.eval(model.parameters())
    return model


def both(target, draft, requests_fn, *, spec=DRAFT, **kw):
    """Results without and with draft speculation (fresh engines, fresh requests), and the speculating engine."""
    reqs, arrivals = requests_fn()
    plain = run_all(make_engine(target, **kw), reqs, arrivals=arrivals)
    engine = make_engine(target, spec=spec, draft=draft, **kw)
    reqs, arrivals = requests_fn()
    return plain, run_all(engine, reqs, arrivals=arrivals), engine


def same(plain, spec, atol=1e-4):
    assert spec.keys() == plain.keys()
    for key in plain:
        assert spec[key]["tokens"] == plain[key]["tokens"], key
        assert spec[key]["finish"] == plain[key]["finish"], key
        np.testing.assert_allclose(spec[key]["logprobs"], plain[key]["logprobs"], atol=atol)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
@pytest.mark.parametrize("draft", ["random", "self", "wide"])
def test_greedy_tokens_and_logprobs_identical_with_and_without_a_draft(arch, draft):
    target = tiny_model(arch)
    model = {"random": lambda: tiny_draft(), "self": lambda: target, "wide": lambda: tiny_draft(vocab=128)}[draft]()
    plain, spec, engine = both(target, model, staggered(lambda i: greedy(24 + 3 * i, logprobs=i % 2 == 0)),
                               max_num_seqs=8)
    same(plain, spec)
    s = engine.stats().spec
    assert s.mode == "draft" and s.verify_passes > 0 and s.emitted_tokens == s.accepted_tokens + s.rows_verified
    if draft == "self":  # the target proposing for itself: every proposal is its own argmax
        assert s.acceptance_rate == 1.0 and s.mean_accepted_tokens > 3, s


def test_n_samples_preemption_and_an_abort_mid_speculation():
    target = tiny_model("llama")

    def reqs():
        return [req(f"r{i}", repetitive(4 + i, 10 + i), greedy(40, logprobs=True), n=3) for i in range(4)], None

    # a KV budget this small preempts rows (and recomputes them) while the others speculate
    plain, spec, engine = both(target, target, reqs, max_num_seqs=12, kv_budget_bytes=160 << 10)
    same(plain, spec)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.spec.accepted_tokens > 0

    # n > 1 siblings copy the prompt from the first one's draft row instead of each prefilling it
    prompt = repetitive(20, 5)
    plain, spec, engine = both(target, tiny_draft(), lambda: ([req("s", prompt, greedy(16), n=4)], None), max_num_seqs=8)
    same(plain, spec)
    assert len(prompt) - 1 <= engine.spec.draft.prefill_tokens < 2 * len(prompt)

    engine = make_engine(target, spec=DRAFT, draft=target, max_num_seqs=8)
    ref = run_all(make_engine(target, max_num_seqs=8), [req(f"r{i}", repetitive(4, i), greedy(30)) for i in range(3)])
    for i in range(3):
        engine.add_request(req(f"r{i}", repetitive(4, i), greedy(30)))
    got: dict = {}
    for step in range(200):
        if step == 4:
            assert engine.spec.control.verify_passes > 0  # it is speculating when r1 goes
            assert engine.abort("r1")
        for o in engine.step():
            got.setdefault(o.rid, []).extend(o.token_ids)
        engine.check_integrity()
        if not engine.has_work():
            break
    assert got["r0"] == ref[("r0", 0)]["tokens"] and got["r2"] == ref[("r2", 0)]["tokens"]
    assert got["r1"] == ref[("r1", 0)]["tokens"][:len(got["r1"])] and len(got["r1"]) < 30
    assert not engine.has_work()


def test_the_draft_rows_follow_the_sequences_and_roll_back():
    target = tiny_model("llama")
    engine = make_engine(target, spec=DRAFT, draft=tiny_draft(), max_num_seqs=8)
    for i in range(3):
        engine.add_request(req(f"r{i}", repetitive(5, i), greedy(20)))
    kv = engine.spec.draft.kv
    for _ in range(6):
        engine.step()
        running = {s.seq_id: s for s in engine.scheduler.running}
        for key, n in kv._length.items():  # the draft never holds more positions than the sequence has
            assert key in running and n <= running[key].num_tokens, (key, n)
    assert kv._length and engine.spec.draft.prefill_tokens > 0  # new rows were prefilled alone
    run_all(engine)


def sampled(i: int, seed: int) -> SamplingParams:
    """Request i's sampling: temperature, top-p, top-k, min-p with a logit bias, min_tokens with a stop token,
    greedy (every processor a speculating row may use), seeded from `seed`; later requests run longer (the batch
    shrinks as the earlier ones finish)."""
    kinds = [dict(temperature=0.9), dict(temperature=0.7, top_p=0.9), dict(temperature=1.2, top_k=8),
             dict(temperature=0.8, min_p=0.1, logit_bias={"3": 2.0}), dict(temperature=1.0, min_tokens=10),
             dict(temperature=0.0)]
    return SamplingParams(max_tokens=16 + 5 * i, seed=seed + i, ignore_eos=i % 6 != 4, stop_token_ids=[5] if i % 6 == 4 else [],
                          logprobs=True, top_logprobs=2, **kinds[i % len(kinds)])


@pytest.mark.parametrize("draft, seed, disable_batch_size", [
    ("random", 100, 8), ("random", 7_001, 8), ("random", 31, 2), ("self", 100, 8), ("self", 555, 3)])
def test_coupled_sampled_rows_emit_plain_decodings_tokens_and_logprobs(draft, seed, disable_batch_size):
    """Coupled acceptance: every sampled row's tokens, logprobs and top alternatives are plain decoding's for its
    seed, with staggered arrivals; with disable_batch_size 2 or 3 a row decodes plainly while more rows run and
    speculates once the others have finished. The target as its own draft proposes the target's own samples:
    every proposal is accepted."""
    target = tiny_model("llama", seed=3)
    model = target if draft == "self" else tiny_draft()
    spec = SpecConfig(mode="draft", k=4, disable_batch_size=disable_batch_size, min_acceptance=0.0)
    assert spec.draft_acceptance == "coupled"  # the default
    plain, got, engine = both(target, model, staggered(lambda i: sampled(i, seed), n=7), spec=spec, max_num_seqs=8)
    same(plain, got)
    for key in plain:
        assert [[t for t, _ in top] for top in got[key]["top"]] == [[t for t, _ in top] for top in plain[key]["top"]]
    s = engine.stats().spec
    assert s.verify_passes > 0 and s.accepted_tokens > 0, s
    if disable_batch_size < 8:
        assert s.steps_off_batch > 0, s
    if draft == "self":
        assert s.acceptance_rate == 1.0, s


def test_rejection_sampled_rows_draw_other_tokens_than_plain_decoding():
    """spec.draft_acceptance rejection (p/q with the residual): greedy rows stay plain decoding's, sampled rows'
    tokens for a seed are not (their distribution is the target's: the chi-square test)."""
    target = tiny_model("llama", seed=3)
    plain, got, engine = both(target, tiny_draft(), staggered(lambda i: sampled(i, 100)), spec=REJECTION,
                              max_num_seqs=8)
    assert got[("r5", 0)]["tokens"] == plain[("r5", 0)]["tokens"]  # greedy
    assert any(got[key]["tokens"] != plain[key]["tokens"] for key in plain)
    assert engine.stats().spec.accepted_tokens > 0


@pytest.mark.parametrize("spec", [DRAFT, REJECTION], ids=["coupled", "rejection"])
def test_sampled_rows_report_the_targets_logprobs_of_the_tokens_they_emit(spec):
    target = tiny_model("llama", seed=3)
    params = [SamplingParams(max_tokens=30, seed=40 + i, temperature=1.0, ignore_eos=True, logprobs=True)
              for i in range(4)]
    engine = make_engine(target, spec=spec, draft=target, max_num_seqs=8)
    res = run_all(engine, [req(f"r{i}", repetitive(3 + i, i), params[i]) for i in range(4)])
    assert engine.stats().spec.accepted_tokens > 0
    for i in range(4):
        prompt, got = repetitive(3 + i, i), res[(f"r{i}", 0)]
        lp = log_softmax(target(mx.array([prompt + got["tokens"]]))[0].astype(mx.float32))
        want = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(got["tokens"])]
        np.testing.assert_allclose(got["logprobs"], want, atol=2e-4)


def test_adapter_rows_verify_under_their_adapter_while_the_draft_runs_base():
    def engine_with(spec):
        target = tiny_model("llama")
        engine = make_engine(target, max_num_seqs=8, spec=spec, draft=tiny_model("llama") if spec else None)
        ref = tiny_model("llama")
        engine.load_adapter("a", config=lora_model(ref, rank=4, seed=2), weights=save_bytes(adapter_tensors(ref)))
        return engine

    plain = run_all(engine_with(None), adapter_rows())
    engine = engine_with(DRAFT)
    same(plain, run_all(engine, adapter_rows()))
    s = engine.stats().spec
    assert s.accepted_tokens > 0 and s.acceptance_rate < 1.0  # base rows accept all; adapter rows do not


def test_mode_draft_without_a_draft_model_is_refused():
    with pytest.raises(ValueError, match="draft model"):
        make_engine(tiny_model("llama"), spec=DRAFT)


def test_vocabulary_mismatch_names_the_difference():
    vocab = {"a": 0, "b": 1, "<s>": 2}
    assert vocabulary_mismatch(vocab, dict(vocab), 3) is None
    assert vocabulary_mismatch(vocab, dict(vocab), 128) is None  # padded logits are fine
    assert "do not cover token id 2" in vocabulary_mismatch(vocab, dict(vocab), 2)
    why = vocabulary_mismatch(vocab, {"a": 0, "c": 1, "<s>": 2}, 3)
    assert "tokenizer differs" in why and "'b' = 1" in why


def test_a_prefix_cache_hit_is_caught_up_by_the_draft():
    """The second request's prompt comes from the prefix cache (the target computes only its tail); the draft,
    which has no row for it, prefills the whole prompt itself, and the tokens stay the target's."""
    target = tiny_model("llama")
    prompt = repetitive(12, 3)
    plain = run_all(make_engine(target), [req("a", prompt, greedy(20))])
    engine = make_engine(target, spec=DRAFT, draft=tiny_draft(), block_size=8)
    first = run_all(engine, [req("a", prompt, greedy(20))])
    before = engine.spec.draft.prefill_tokens
    again = run_all(engine, [req("b", prompt, greedy(20))])
    assert engine.stats().prefix_hit_tokens >= 32
    assert first[("a", 0)]["tokens"] == again[("b", 0)]["tokens"] == plain[("a", 0)]["tokens"]
    assert engine.spec.draft.prefill_tokens - before >= len(prompt) - 1 - 8  # the whole prompt, in the draft


def test_the_drafts_passes_run_under_the_engines_attention_stand_ins(monkeypatch):
    """The draft's passes use the stand-ins the target's passes use (here the CPU's fast math; on CUDA the
    unfused attention), not mlx-lm's own call: on CUDA that composes a masked decode, and builds a cuDNN graph
    for every new shape of a multi-token pass, whose key span grows every cycle."""
    target = tiny_model("llama")
    engine = make_engine(target, spec=DRAFT, draft=tiny_draft(), max_num_seqs=8)
    stock = mx.fast.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or stock(*a, **k))
    run_all(engine, [req("r0", repetitive(5, 0), greedy(16))])
    assert engine.stats().spec.verify_passes > 0 and engine.spec.draft.prefill_tokens > 0
    assert not calls


def test_a_cycle_hands_each_draft_pass_to_the_device_and_evaluates_once(monkeypatch):
    """A speculating step: k async launches (each draft pass as soon as it is built), then one evaluation
    (the verify pass, the draft's graph under it)."""
    target = tiny_model("llama")
    engine = make_engine(target, spec=DRAFT, draft=target, max_num_seqs=8)
    engine.add_request(req("r0", repetitive(5, 0), greedy(24)))
    while engine.stats().spec.verify_passes == 0:
        engine.step()
    counts = {"eval": 0, "async_eval": 0}
    for name in counts:
        real = getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda *a, _n=name, _f=real: counts.__setitem__(_n, counts[_n] + 1) or _f(*a))
    before = engine.stats().spec.verify_passes
    engine.step()
    assert engine.stats().spec.verify_passes == before + 1
    assert counts == {"eval": 1, "async_eval": DRAFT.k}
    run_all(engine)
