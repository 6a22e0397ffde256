"""Grammar constraints in the engine (parallm/engine/constraints.py, sampling.apply_bitmask) on a
tiny model whose 101 tokens are single characters, with the real llguidance matcher."""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np
import pytest

from parallm.engine import RequestRejected
from parallm.engine.sampling import BatchParams, Sampler
from parallm.protocol import Constraint, SamplingParams
from parallm.text.grammar import GrammarError, grammar_text
from tests._engine_helpers import TINY_VOCAB, make_engine, req, run_all, tiny_model

EOS = 0
CHARS = '{}[]",:. -_0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n!?()+*/=<>@#$%&;\'^`|~'
TOKENS = [b"<eos>"] + [c.encode() for c in CHARS] + [b"\t", b"\\", b"ab", b"true", b"null"]
assert len(TOKENS) == TINY_VOCAB


class _CharTokenizer:
    """One character per token (id 0 is EOS): what llguidance needs to know of a vocabulary."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = TOKENS
    special_token_ids = [EOS]

    def __call__(self, s: bytes) -> list[int]:
        return [TOKENS.index(bytes([b])) for b in s]  # multi-character tokens are only sampled


def char_tokenizer():
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_CharTokenizer()))


def text_of(ids: list[int]) -> str:
    return "".join(TOKENS[t].decode() for t in ids if t != EOS)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def engine_on(model, **kw):
    engine = make_engine(model, eos=[EOS], **kw)
    engine.constraints.use_tokenizer(char_tokenizer())
    return engine


def c_schema(schema=SCHEMA) -> Constraint:
    return Constraint(kind="json_schema", value=json.dumps(schema))


def _allowed(matcher) -> np.ndarray:
    bm = np.zeros((1, (TINY_VOCAB + 31) // 32), dtype=np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, bm, 0)
    bits = np.unpackbits(bm.view(np.uint8), bitorder="little")[:TINY_VOCAB]
    return bits.astype(bool)


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_are_those_of_the_masked_temperature_scaled_distribution(model, overlap):
    """Each constrained token's reported logprob = log softmax(masked logits / T) at that token,
    with the overlapped schedule too (the mask then follows a token read after the next launch)."""

    engine = engine_on(model, overlap=overlap)
    T = 0.7
    p = SamplingParams(temperature=T, max_tokens=60, seed=3, logprobs=True, constraint=c_schema())
    r = run_all(engine, [req("a", [5, 6, 7], p)])[("a", 0)]
    ids, lps = r["tokens"], r["logprobs"]
    assert r["finish"] == "stop" and ids[-1] == EOS
    doc = json.loads(text_of(ids))
    assert isinstance(doc["a"], int) and doc["b"] in ("x", "yz")
    m = llguidance.LLMatcher(char_tokenizer(), grammar_text("json_schema", json.dumps(SCHEMA)))
    prompt = [5, 6, 7]
    for i, tok in enumerate(ids):
        logits = model(mx.array([prompt + ids[:i]]))[0, -1].astype(mx.float32)
        allowed = _allowed(m)
        assert allowed[tok]
        z = np.where(allowed, np.array(logits) / T, -np.inf)
        ref = z[tok] - np.log(np.sum(np.exp(z - z.max()))) - z.max()
        assert abs(lps[i] - ref) < 1e-5, (i, lps[i], ref)
        assert m.consume_token(tok)


def test_sampler_applies_the_mask_before_temperature_and_filters():
    V = TINY_VOCAB
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(3, V)).astype(np.float32))
    allowed = np.zeros((3, V), dtype=bool)
    allowed[0, [4, 9, 60]] = True
    allowed[1, :] = True  # an unconstrained row
    allowed[2, [100]] = True
    bm = np.packbits(np.pad(allowed, ((0, 0), (0, 128 - V))), axis=1, bitorder="little").view(np.int32)

    class S:
        def __init__(self, p):
            self.params, self.seed, self.uses_penalties = p, 1, False
            self.wants_logprobs = True

    seqs = [S(SamplingParams(temperature=0.5, top_k=2, logprobs=True)), S(SamplingParams(temperature=0.0, logprobs=True)),
            S(SamplingParams(temperature=2.0, logprobs=True))]
    out = Sampler(V).sample(logits, BatchParams(seqs, [0], V), [0, 0, 0], bitmask=mx.array(bm))
    toks, lps = out.tokens.tolist(), out.logprobs.tolist()
    raw = np.array(logits)
    for row, (tok, T, k) in enumerate(zip(toks, (0.5, 1.0, 2.0), (2, 0, 0))):
        assert allowed[row, tok]
        z = np.where(allowed[row], raw[row] / T, -np.inf)
        if k:
            z = np.where(z >= np.sort(z)[-k], z, -np.inf)
        ref = z[tok] - (np.log(np.sum(np.exp(z - z.max()))) + z.max())
        assert abs(lps[row] - ref) < 1e-5
    assert toks[1] == int(np.argmax(raw[1])) and toks[2] == 100 and abs(lps[2]) < 1e-6


def test_constrained_output_follows_the_grammar_batched_with_free_rows_and_n_siblings(model):
    engine = engine_on(model, max_num_seqs=8)
    free = SamplingParams(temperature=1.0, max_tokens=12, seed=1)
    rx = SamplingParams(temperature=1.0, max_tokens=30, seed=2, constraint=Constraint(kind="regex", value="(ab|cd)+!"))
    ch = SamplingParams(temperature=1.0, max_tokens=30, seed=4, constraint=Constraint(kind="choice", value='["yes", "no"]'))
    js = SamplingParams(temperature=1.0, max_tokens=60, seed=5, constraint=c_schema())
    res = run_all(engine, [req("free", [1, 2], free), req("rx", [3, 4], rx, n=3), req("ch", [5], ch),
                           req("js", [9, 9, 9], js, n=2)])
    assert len(res[("free", 0)]["tokens"]) == 12
    for i in range(3):
        r = res[("rx", i)]
        text = text_of(r["tokens"])
        assert r["finish"] == "stop" and text.endswith("!") and set(text[:-1]) <= set("abcd"), text
    assert text_of(res[("ch", 0)]["tokens"]) in ("yes", "no")
    for i in range(2):
        doc = json.loads(text_of(res[("js", i)]["tokens"]))
        assert set(doc) == {"a", "b"}
    stats = engine.constraints.stats()
    assert stats["constrained_rows"] == 0 and stats["grammars_compiled"] == 3  # finished rows are forgotten


def test_same_seed_gives_the_same_constrained_tokens_alone_in_a_batch_and_overlapped(model):
    p = SamplingParams(temperature=1.0, max_tokens=50, seed=11, constraint=c_schema())
    alone = run_all(engine_on(model), [req("a", [4, 4], p)])[("a", 0)]["tokens"]
    others = [req(f"o{i}", [i + 1], SamplingParams(temperature=1.0, max_tokens=20, seed=i)) for i in range(5)]
    batched = run_all(engine_on(model), others + [req("a", [4, 4], p)])[("a", 0)]["tokens"]
    assert alone == batched
    overlapped = engine_on(model, overlap=True)
    res = run_all(overlapped, others + [req("a", [4, 4], p), req("b", [4, 4], p, n=2)])
    assert res[("a", 0)]["tokens"] == alone and res[("b", 0)]["tokens"] == alone
    assert res[("b", 1)]["tokens"] != alone and json.loads(text_of(res[("b", 1)]["tokens"]))

    kept = engine_on(model, overlap=True)
    kept.add_request(req("c", [4, 4], p))
    in_flight = []
    while kept.has_work():
        kept.step()
        in_flight.append(len(kept._launches))
    assert in_flight.count(1) >= len(alone) - 2  # the constrained row's passes stay in flight (overlap kept)


def test_max_tokens_mid_json_ends_with_length_and_the_partial_text(model):
    p = SamplingParams(temperature=1.0, max_tokens=4, seed=0, constraint=c_schema())
    r = run_all(engine_on(model), [req("a", [1], p)])[("a", 0)]
    assert r["finish"] == "length" and len(r["tokens"]) == 4 and text_of(r["tokens"]).startswith('{')


def test_preemption_by_recompute_keeps_the_constraint(model):
    """A KV budget too small for every row preempts some; the matchers replay the kept outputs,
    so every output is the one a roomy engine gives (same seeds) and follows the grammar."""
    rx = Constraint(kind="regex", value="[a-z]{30,40}!")
    reqs = lambda: [req(f"r{i}", [1, 2, 3 + i], SamplingParams(temperature=1.0, max_tokens=45, seed=i,  # noqa: E731
                                                              constraint=rx)) for i in range(6)]
    roomy = run_all(engine_on(model), reqs())
    for overlap in (False, True):  # overlapped: a preempted row's token in flight is dropped, its matcher rolled back
        tight = engine_on(model, kv_budget_bytes=512 * 110, prefix_pool_fraction=0.0, prefix_cache=False,
                          overlap=overlap)
        res = run_all(tight, reqs())
        assert tight.stats().preemptions > 0
        for key, d in roomy.items():
            assert res[key]["tokens"] == d["tokens"] and res[key]["finish"] == d["finish"], (overlap, key)
    for key, d in roomy.items():
        text = text_of(d["tokens"])
        assert d["finish"] == "stop" and text.endswith("!") and 30 <= len(text) - 1 <= 40 and text[:-1].isalpha()


def test_bad_constraints_are_rejected_naming_the_problem(model):
    engine = engine_on(model)
    bad = SamplingParams(constraint=Constraint(kind="json_schema", value='{"if": {}, "then": {}}'))
    with pytest.raises(RequestRejected, match="if, then"):
        engine.add_request(req("a", [1], bad))
    with pytest.raises(RequestRejected, match="min_tokens"):
        engine.add_request(req("b", [1], SamplingParams(min_tokens=2, constraint=c_schema())))
    with pytest.raises(RequestRejected, match="unknown constraint kind"):
        engine.add_request(req("c", [1], SamplingParams(constraint=Constraint(kind="xml", value="x"))))
    assert not engine.has_work()
    with pytest.raises(GrammarError, match="look-around"):
        grammar_text("regex", "(?=a)b")


def test_row_matcher_follows_outputs_and_the_token_in_flight():
    """The matcher consumes the token still in flight (overlap); one the sequence did not keep is
    rolled back, and a matcher in error is replayed from the outputs."""
    from parallm.engine.constraints import RowMatcher

    tok = char_tokenizer()
    grammar = grammar_text("regex", "(ab|cd)+!")
    ids = {c: TOKENS.index(c.encode()) for c in "abcd!"}
    template = llguidance.LLMatcher(tok, grammar)
    row = RowMatcher(template)
    row.sync([ids["a"]], pending=ids["b"])
    assert row.ids == [ids["a"], ids["b"]] and row.confirmed == 1
    assert _allowed(row.matcher)[ids["c"]] and not _allowed(row.matcher)[ids["b"]]
    row.sync([ids["a"], ids["b"], ids["c"]], pending=None)  # the token in flight was kept, and one more
    assert row.ids == [ids["a"], ids["b"], ids["c"]] and _allowed(row.matcher)[ids["d"]]
    row.sync([ids["a"], ids["b"], ids["c"]], pending=ids["d"])
    row.sync([ids["a"], ids["b"]], pending=ids["a"])  # shorter outputs (never expected): replayed
    assert row.ids == [ids["a"], ids["b"], ids["a"]] and _allowed(row.matcher)[ids["b"]]
    row = RowMatcher(template)
    row.sync([ids["c"]], pending=ids["d"])
    row.sync([ids["c"]], pending=ids["c"])  # "d" was dropped (its pass discarded): rolled back, then "c"
    assert row.ids == [ids["c"], ids["c"]] and row.matcher.is_error()  # "cc" is outside the grammar
    row.sync([ids["c"], ids["d"]], pending=ids["!"])  # an errored matcher cannot roll back: replayed
    assert not row.matcher.is_error() and row.matcher.is_accepting()


THINK, END = TOKENS.index(b"@"), TOKENS.index(b"#")  # this vocabulary's thinking markers in the tests below


def thinking_engine(model, **kw):
    engine = engine_on(model, **kw)
    engine.constraints.use_thinking(((THINK,), (END,)))
    return engine


def split_thinking(ids: list[int]) -> tuple[list[int], str]:
    """(the thinking tokens with their markers, the answer's text) of an output."""
    j = ids.index(END) + 1
    return ids[:j], text_of(ids[j:])


@pytest.mark.parametrize("overlap", [False, True])
def test_after_reasoning_the_grammar_begins_after_the_end_marker(model, overlap):
    """The prompt opened a thinking segment: free tokens until its end marker, then the grammar
    (vLLM's reasoning-aware structured output); logprobs exact in both parts."""
    import llguidance

    engine = thinking_engine(model, overlap=overlap)
    c = Constraint(kind="json_schema", value=json.dumps(SCHEMA), after_reasoning=True)
    prompt = [5, 6, THINK]
    p = SamplingParams(temperature=1.0, max_tokens=120, seed=7, logprobs=True, logit_bias={END: 2.5}, constraint=c)
    r = run_all(engine, [req("a", prompt, p)])[("a", 0)]
    ids, lps = r["tokens"], r["logprobs"]
    thinking, answer = split_thinking(ids)
    assert r["finish"] == "stop" and len(thinking) > 2 and set(json.loads(answer)) == {"a", "b"}
    assert set(text_of(thinking[:-1])) - set('{}[]",:') , "the thinking is free text, not JSON"
    m = llguidance.LLMatcher(char_tokenizer(), grammar_text("json_schema", json.dumps(SCHEMA)))
    for i, tok in enumerate(ids):
        logits = np.array(model(mx.array([prompt + ids[:i]]))[0, -1].astype(mx.float32))
        logits[END] += 2.5
        allowed = _allowed(m) if i >= len(thinking) else np.ones(TINY_VOCAB, dtype=bool)
        z = np.where(allowed, logits, -np.inf)
        ref = z[tok] - np.log(np.sum(np.exp(z - z.max()))) - z.max()
        assert abs(lps[i] - ref) < 1e-4, (i, lps[i], ref)
        if i >= len(thinking):
            assert m.consume_token(tok)


def test_after_reasoning_the_first_token_may_open_thinking_or_answer_at_once(model):
    c = Constraint(kind="json_schema", value=json.dumps(SCHEMA), after_reasoning=True)
    opens = SamplingParams(temperature=1.0, max_tokens=120, seed=3, logit_bias={THINK: 30.0, END: 40.0}, constraint=c)
    at_once = SamplingParams(temperature=1.0, max_tokens=60, seed=3, logit_bias={THINK: -30.0}, constraint=c)
    closed = SamplingParams(temperature=1.0, max_tokens=60, seed=3, logit_bias={THINK: 30.0}, constraint=c)
    res = run_all(thinking_engine(model), [req("opens", [5, 6], opens), req("now", [5, 6], at_once),
                                           req("closed", [5, THINK, 9, END], closed),
                                           req("plain", [5, 6], SamplingParams(temperature=1.0, max_tokens=60, seed=3,
                                                                               logit_bias={THINK: 30.0},
                                                                               constraint=c_schema()))])
    ids = res[("opens", 0)]["tokens"]
    thinking, answer = split_thinking(ids)  # "@" may start the output (the bias picks it), "#" ends the segment
    assert thinking == [THINK, END] and set(json.loads(answer)) == {"a", "b"}
    # a first token that does not open, a prompt that closed it, no after_reasoning
    for key in ("now", "closed", "plain"):
        ids = res[(key, 0)]["tokens"]
        assert text_of(ids).startswith("{") and THINK not in ids and set(json.loads(text_of(ids))) == {"a", "b"}, key


def test_think_gate_markers_from_a_tokenizer_json(tmp_path):
    from parallm.engine.think_gate import ThinkGate, thinking_from_file

    tok = {"added_tokens": [{"id": 7, "content": "<think>"}, {"id": 8, "content": "</think>"}], "model": {}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    markers = thinking_from_file(tmp_path / "tokenizer.json")
    assert markers == ((7,), (8,))
    (tmp_path / "none.json").write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<think>"}]}))
    assert thinking_from_file(tmp_path / "none.json") is None
    gate = ThinkGate(markers, [1, 7, 2])  # the prompt opened it
    assert gate.opener is None and gate.begin([3, 4]) is None and gate.begin([3, 4], pending=8) == 3
    assert gate.begin([3, 4, 8, 5]) == 3
    gate = ThinkGate(markers, [1, 7, 2, 8, 3, 4, 5])  # opened and closed (an earlier turn): the first token may open
    assert gate.opener == 7 and gate.begin([]) is None and gate.begin([5]) == 0
    gate = ThinkGate(markers, [1, 7, 2, 8, 3, 4, 5])
    assert gate.begin([7, 3]) is None and gate.begin([7, 3, 8, 6]) == 3
    gate = ThinkGate(markers, [1, 7, 8, 3])  # closed at the prompt's end (thinking off): the answer at once
    assert gate.opener is None and gate.begin([]) == 0


def test_think_gate_of_a_harmony_vocabulary_begins_at_the_final_message(tmp_path):
    """gpt-oss: the answer is the final channel's message; analysis before it is free."""
    from tokenizers import Tokenizer

    from parallm.config import ModelConfig
    from parallm.engine.think_gate import ThinkGate, thinking_from_file
    from parallm.models import resolve_model

    tok = json.loads((resolve_model(ModelConfig()).path / "tokenizer.json").read_text())
    names = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>"]
    base = 49152
    tok["added_tokens"] += [{"id": base + i, "content": n, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, n in enumerate(names)]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok))
    markers = thinking_from_file(path)
    start, end, then = markers
    hf = Tokenizer.from_file(str(path))
    ids = lambda text: hf.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert start == (base,) and end == tuple(ids("<|channel|>final")) and then == base + 2
    assert end[0] == base + 3
    prompt = ids("<|start|>user<|message|>hi<|end|><|start|>assistant")
    gate = ThinkGate(markers, prompt)
    assert gate.opener is None
    out = ids("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>{")
    assert gate.begin(out[:-2]) is None
    assert gate.begin(out[:-1]) == len(out) - 1 and gate.begin(out) == len(out) - 1
    # gpt-oss's header for a response format: the grammar begins after its <|message|>, not inside it
    gate = ThinkGate(markers, prompt)
    out = ids("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final <|constrain|>json"
              "<|message|>{")
    assert gate.begin(out[:-2]) is None
    assert gate.begin(out[:-1]) == len(out) - 1 and gate.begin(out) == len(out) - 1


def test_a_constrained_decode_waits_for_the_device_once_before_its_pass(model, monkeypatch):
    """With the live KV written in place (engine.in_place_kv_mb 0: always wait), a constrained decode
    pass is launched (after the wait) before its masks are read; the sampling launched after it writes
    no KV and must not wait for that pass too, or the pass stops overlapping the next step."""
    from parallm.engine import cache

    waits = []
    real = cache.mx.synchronize
    monkeypatch.setattr(cache.mx, "synchronize", lambda *a: (waits.append(1), real(*a))[1])
    engine = engine_on(model, in_place_kv_mb=0)
    p = SamplingParams(temperature=1.0, max_tokens=40, seed=3, constraint=c_schema())
    engine.add_request(req("c", [5, 6, 7], p))
    for _ in range(4):
        engine.step()
    counts = []
    for _ in range(5):
        waits.clear()
        engine.step()
        counts.append(len(waits))
    assert counts == [1] * 5


def test_a_constrained_first_token_s_mask_is_filled_while_its_pass_runs(model, monkeypatch):
    """Issue 30: a prompt's first-token mask (a prefill pass, or its chunk in a mixed pass) was waited for before
    the pass was launched, so the pass ran after the mask (~10 ms for a 64 KiB grammar on the default model's
    vocabulary, every constrained request). Now the pass is launched first and the worker fills the mask beside it."""
    events: list[str] = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (events.append("launch"), real_async_eval(*a))[1])
    for mixed in (False, True):
        engine = engine_on(model)
        submit = engine.constraints.submit

        def tracked(*a, **kw):
            future = submit(*a, **kw)
            result = future.result
            future.result = lambda *ra: (events.append("mask"), result(*ra))[1]
            return future

        engine.constraints.submit = tracked
        if mixed:  # a free row decodes: the constrained prompt rides in its pass
            engine.add_request(req("free", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
            engine.step()
        events.clear()
        engine.add_request(req("c", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, constraint=c_schema())))
        engine.step()
        assert engine.stats().mixed_passes == int(mixed)
        assert events[:2] == ["launch", "mask"], (mixed, events)
        run_all(engine)


def test_a_grammar_s_first_mask_is_filled_when_it_compiles_not_on_the_step_loop(model, monkeypatch):
    """Issue 30: a new matcher's first mask is its costliest (4-12 ms for a 64 KiB choice list on the default
    model's 49k tokens) and the same for every sequence of the grammar: it is filled by the compile (the engine
    stage's compile thread), and a constrained prompt's first token no longer waits for it on the step loop."""
    engine = engine_on(model)
    c = c_schema()
    engine.constraints.check(c)  # what the stage's compile thread runs before the request goes in
    want = np.zeros((1, (TINY_VOCAB + 31) // 32), dtype=np.int32)
    grammar = engine.constraints._template(c)
    llguidance.numpy.fill_next_token_bitmask(getattr(grammar, "matcher", grammar).deep_copy(), want, 0)
    filled = []
    real = llguidance.numpy.fill_next_token_bitmask_par
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par",
                        lambda executor, work, buf: (filled.append(len(work)), real(executor, work, buf))[1])
    engine.add_request(req("c", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, constraint=c)))
    np.testing.assert_array_equal(engine.constraints.masks(engine._requests["c"]), want)
    assert filled == []
    out = run_all(engine)[("c", 0)]["tokens"]
    assert filled and out[0] in np.flatnonzero(np.unpackbits(want.view(np.uint8), bitorder="little"))


def test_a_choice_list_of_thousands_is_followed_past_its_first_token(model):
    """Every constraint the size check admits can be followed to its end: 2,800 choices (a 64 KiB list in the
    isolation benchmark) passed engine.max_constraint_bytes, compiled, and then failed on the second token
    (llguidance's default max_items_in_row is 2,000), so the row ended after one token that is no choice."""
    choices = [f"a{i:04d}" for i in range(2800)]
    engine = engine_on(model)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3,
                            constraint=Constraint(kind="choice", value=json.dumps(choices)))
    res = run_all(engine, [req("many", [5, 6], params)])
    assert text_of(res[("many", 0)]["tokens"]) in choices
    assert res[("many", 0)]["finish"] == "stop"



CHOICE_EDGES = ["a", "ab", "", "/", "\\", "\n", "\t", "é", '"', "a|b", "(x)", "[", "^$.*+?{}", "#x", "a-b~&", "x  y"]


@pytest.mark.parametrize("choices", [CHOICE_EDGES, ["a", "a"], [""], ["x y"]])
def test_a_choice_grammar_accepts_each_choice_and_nothing_else(choices):
    """The choice list compiles as one regex lexeme (grammar.choice_grammar): every character that means something
    in a regex, or ends the Lark /.../ it sits in, is escaped, so each choice matches itself and nothing else, as
    llguidance's own choice form did."""
    tok = char_tokenizer()
    text = grammar_text("choice", json.dumps(choices))
    ours = [s for s in choices if all(s.encode() == b"" or bytes([b]) in TOKENS for b in s.encode())]
    others = ["zz", "a|", "ab|", "(x", "x y ", "\\\\", ".", "aa", "b"]
    for s, want in [*((s, True) for s in ours), *((s, s in choices) for s in others)]:
        m = llguidance.LLMatcher(tok, text, log_level=0)
        consumed = m.consume_tokens(_CharTokenizer()(s.encode())) if s else True
        ends = consumed and not m.is_error() and bool(_allowed(m)[EOS])
        assert ends == want, (s, text)


def test_a_choice_list_is_one_item_of_the_parser_row_however_long():
    """Issue 30: llguidance's own choice form made each of a 64 KiB list's 2,800 choices a lexeme and an item of the
    parser's row (compile 17 ms and a 1.6 ms mask per token on the default model's tokenizer; three such lists at
    once left other users' steps waiting on the 2-core CPU). As one regex lexeme the row holds one item, so the
    list decodes under a row limit far below its length."""
    choices = [f"a{i:04d}" for i in range(2800)]
    m = llguidance.LLMatcher(char_tokenizer(), grammar_text("choice", json.dumps(choices)), log_level=0,
                             limits=llguidance.LLParserLimits(max_items_in_row=10))
    assert not m.is_error(), m.get_error()
    assert m.consume_tokens(_CharTokenizer()(b"a1234")), m.get_error()
    assert _allowed(m)[EOS] and not m.is_error()


def test_the_engine_compiles_a_grammar_without_validating_it_again(model, monkeypatch):
    """The API process validated the constraint (grammar.check); the engine's compile builds the grammar and lets
    its matcher report errors (validating again cost 5-8 ms of a 64 KiB grammar's compile, issue 30), with the
    same message."""
    engine = engine_on(model)
    calls = []
    real = llguidance.LLMatcher.validate_grammar
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    engine.constraints.check(Constraint(kind="choice", value='["yes", "no"]'))
    with pytest.raises(GrammarError, match="look-around"):
        engine.constraints.check(Constraint(kind="regex", value="(?=a)b"))
    assert calls == []


def test_the_api_checks_a_choice_list_without_llguidance_s_validation(monkeypatch):
    """A choice list's grammar escapes every choice, so it cannot fail llguidance's validation: the API process
    (grammar.check) only checks that it is a non-empty list of strings, and spends no validation on the cores the
    engine steps on (issue 30); other kinds are validated as before."""
    from parallm.text import grammar

    calls = []
    real = llguidance.LLMatcher.validate_grammar
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    grammar.check(Constraint(kind="choice", value=json.dumps([f"c{i}" for i in range(2800)])))
    assert calls == []
    for bad in ("[]", '["a", 1]', "{", '"a"'):
        with pytest.raises(GrammarError, match="choice needs a non-empty list of strings"):
            grammar.check(Constraint(kind="choice", value=bad))
    with pytest.raises(GrammarError, match="look-around"):
        grammar.check(Constraint(kind="regex", value="(?=b)a"))
    assert calls
