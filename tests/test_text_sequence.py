"""DetokState: engine deltas to client outputs with vLLM's stop semantics, usage and rollouts."""

from __future__ import annotations

import random

import pytest
from text_tokenizers import byte_bpe, byte_token, random_text

from parallm.protocol import (DetokSpec, Output, RequestSpec, SeqDelta, Track, Usage, pack_floats, pack_ids, unpack_floats,
                              unpack_ids)
from parallm.text.sequence import DetokState
from parallm.text.vocab import TokenizerView


@pytest.fixture(scope="module")
def tok():
    return byte_bpe()


@pytest.fixture(scope="module")
def view(tok):
    return TokenizerView(tok)


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def delta(ids, *, version=0, finish=None, usage=None, top_k=0, rid="r"):
    """A SeqDelta whose logprob of the i-th token overall is -i/1000 (to check slicing)."""
    return SeqDelta(rid=rid, token_ids=pack_ids(ids), logprobs=pack_floats([-t / 1000 for t in ids]),
                    top_ids=pack_ids([t for t in ids for _ in range(top_k)]),
                    top_logprobs=pack_floats([-1.0] * (len(ids) * top_k)),
                    version=version, finish_reason=finish, usage=usage)


def feed_all(state, chunks, finish="length", usage=None):
    outs = []
    for j, chunk in enumerate(chunks):
        last = j == len(chunks) - 1
        out = state.update(delta(chunk, finish=finish if last else None, usage=usage if last else None), now=j + 1.0)
        if out is not None:
            outs.append(out)
    return outs


def test_stop_string_across_tokens_truncates_ids_text_and_usage(tok, view):
    gen = ids_of(tok, "The answer is 42.</answer> and then more text")
    spec = DetokSpec(stop=["</answer>"])
    st = DetokState(view, "r", 0, ids_of(tok, "Q: "), spec)
    outs = feed_all(st, [[t] for t in gen], usage=Usage(prompt_tokens=3, completion_tokens=len(gen)))
    text = "".join(o.text for o in outs)
    assert text == "The answer is 42."
    assert st.finish_reason == "stop" and st.stop_reason == "</answer>"
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "</answer>"
    kept = [t for o in outs for t in unpack_ids(o.token_ids)]
    # the kept ids are exactly the shortest prefix whose decode contains the stop string
    k = next(k for k in range(len(gen) + 1) if "</answer>" in tok.decode(gen[:k]))
    assert kept == gen[:k]
    assert outs[-1].usage == Usage(prompt_tokens=len(ids_of(tok, "Q: ")), completion_tokens=k)
    assert st.needs_abort                       # the engine is still generating it
    assert st.update(delta(gen[:1])) is None    # the engine ran ahead: ignored
    assert st.text == text


def test_stop_string_in_the_first_token(tok, view):
    first = ids_of(tok, "hello")[0]
    st = DetokState(view, "r", 0, [], DetokSpec(stop=[tok.decode([first])]))
    out = st.update(delta([first, first]))
    assert out.text == "" and out.finish_reason == "stop"
    assert unpack_ids(out.token_ids) == [first] and len(unpack_floats(out.logprobs)) == 1
    assert out.usage.completion_tokens == 1


def test_multi_token_delta_keeps_tokens_up_to_the_completing_one(tok, view):
    gen = ids_of(tok, "ab STOP cd")
    st = DetokState(view, "r", 0, [], DetokSpec(stop=["STOP"], token_strings=True))
    out = st.update(delta(gen, top_k=2, finish=None))
    k = next(k for k in range(len(gen) + 1) if "STOP" in tok.decode(gen[:k]))
    assert k < len(gen)
    assert out.text == "ab "
    assert unpack_ids(out.token_ids) == gen[:k]
    assert unpack_floats(out.logprobs) == pytest.approx([-t / 1000 for t in gen[:k]])
    assert unpack_ids(out.top_ids) == [t for t in gen[:k] for _ in range(2)]
    assert len(unpack_floats(out.top_logprobs)) == 2 * k
    assert out.tokens == view.token_strings(gen[:k])
    assert out.top_tokens == view.token_strings([t for t in gen[:k] for _ in range(2)])
    assert st.needs_abort


def test_include_stop_str_keeps_the_stop_text(tok, view):
    st = DetokState(view, "r", 0, [], DetokSpec(stop=["\n\n"], include_stop_str=True))
    outs = feed_all(st, [[t] for t in ids_of(tok, "line one\n\nline two")])
    assert "".join(o.text for o in outs) == "line one\n\n"
    assert st.stop_reason == "\n\n"


def test_stop_during_the_final_delta_does_not_ask_for_an_abort(tok, view):
    st = DetokState(view, "r", 0, [], DetokSpec(stop=["x"]))
    out = st.update(delta(ids_of(tok, "abx"), finish="length", usage=Usage(prompt_tokens=0, completion_tokens=3,
                                                                              cached_tokens=5)))
    assert out.finish_reason == "stop" and out.stop_reason == "x" and not st.needs_abort
    assert out.usage.cached_tokens == 5


def test_eos_token_text_is_left_out_but_the_id_kept(tok, view):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    gen = ids_of(tok, "done") + [eos]
    st = DetokState(view, "r", 0, [], DetokSpec(skip_special_tokens=False, token_strings=True))
    outs = feed_all(st, [[t] for t in gen], finish="stop", usage=Usage(prompt_tokens=0, completion_tokens=len(gen)))
    assert "".join(o.text for o in outs) == "done"
    assert unpack_ids(outs[-1].token_ids) == [eos] and outs[-1].tokens == ["<|im_end|>"]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert outs[-1].usage.completion_tokens == len(gen)


def test_stop_token_id_that_is_ordinary_text(tok, view):
    nl = ids_of(tok, "\n")
    assert len(nl) == 1
    gen = ids_of(tok, "first line") + nl
    st = DetokState(view, "r", 0, [], DetokSpec(), stop_token_ids=nl)
    outs = feed_all(st, [gen], finish="stop")
    assert outs[0].text == "first line" and outs[0].stop_reason == nl[0]
    st = DetokState(view, "r", 0, [], DetokSpec(include_stop_str=True), stop_token_ids=nl)
    assert feed_all(st, [gen], finish="stop")[0].text == "first line\n"


def test_held_partial_character_and_stop_prefix_flush_at_finish(tok, view):
    euro = "€".encode()
    gen = ids_of(tok, "price 5") + [byte_token(tok, euro[0]), byte_token(tok, euro[1])]
    st = DetokState(view, "r", 0, [], DetokSpec(stop=["5€0"]))
    outs = feed_all(st, [[t] for t in gen], finish="length")
    assert [o.text for o in outs][-1] == "5\ufffd"
    assert "".join(o.text for o in outs) == tok.decode(gen)
    assert st.finish_reason == "length" and st.stop_reason is None


def test_min_tokens_ignores_stops_completed_early(tok, view):
    gen = ids_of(tok, "x.y.z.")
    stop_at = [i for i in range(1, len(gen) + 1) if tok.decode(gen[:i]).endswith(".")]
    st = DetokState(view, "r", 0, [], DetokSpec(stop=["."]), min_tokens=stop_at[0])
    outs = feed_all(st, [[t] for t in gen])
    assert "".join(o.text for o in outs) == tok.decode(gen[:stop_at[1]])[:-1]


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_is_always_a_prefix_of_the_final_text(tok, view, seed):
    rng = random.Random(seed)
    for _ in range(60):
        text = random_text(rng, 80)
        gen = ids_of(tok, text)
        stops = [text[i:i + rng.randint(1, 4)] for i in (rng.randrange(max(1, len(text))) for _ in range(2))]
        stops = [s for s in stops if s] + ["zzq"]
        st = DetokState(view, "r", 0, ids_of(tok, random_text(rng, 10)), DetokSpec(stop=stops))
        chunks, i = [], 0
        while i < len(gen):
            n = rng.randint(1, 3)
            chunks.append(gen[i:i + n])
            i += n
        outs = feed_all(st, chunks or [[]])
        streamed = ""
        final = st.text
        for o in outs:
            streamed += o.text
            assert final.startswith(streamed)
            assert not any(s in streamed for s in stops)
        full = tok.decode(gen)
        cut = min((full.find(s) + len(s), full.find(s)) for s in stops if s in full) if any(s in full for s in stops) else None
        assert final == (full if cut is None else full[:cut[1]])


def test_version_spans_are_compacted(tok, view):
    st = DetokState(view, "r", 2, [1, 2], DetokSpec(), adapter="pol", submitted_at=0.5, metadata={"k": 1})
    for version, ids in [(3, [5, 6]), (3, [7]), (4, [8]), (4, [9, 10]), (6, [11])]:
        st.update(delta(ids, version=version), now=10.0 + version)
    st.update(delta([12], version=6, finish="length"), now=20.0)
    ro = st.rollout()
    assert ro.versions == [(0, 3), (3, 4), (6, 6)]
    assert unpack_ids(ro.completion_ids) == [5, 6, 7, 8, 9, 10, 11, 12]
    assert unpack_floats(ro.logprobs) == pytest.approx([-t / 1000 for t in range(5, 13)])
    assert unpack_ids(ro.prompt_ids) == [1, 2]
    assert (ro.rid, ro.index, ro.adapter, ro.finish_reason, ro.metadata) == ("r", 2, "pol", "length", {"k": 1})
    assert (ro.submitted_at, ro.first_token_at, ro.finished_at) == (0.5, 13.0, 20.0)


def test_rollout_after_a_stop_string_holds_only_kept_tokens(tok, view):
    gen = ids_of(tok, "abc END xyz")
    st = DetokState(view, "r", 0, [], DetokSpec(stop=["END"]))
    feed_all(st, [gen[:2], gen[2:]], finish=None)
    ro = st.rollout()
    assert ro.text == "abc " and ro.finish_reason == "stop"
    assert len(unpack_ids(ro.completion_ids)) == st.num_tokens == len(unpack_floats(ro.logprobs))


def test_without_a_spec_ids_pass_through(view):
    st = DetokState(view, "r", 0, [1, 2, 3], None)
    out = st.update(delta([40, 41], finish="length", usage=Usage(prompt_tokens=3, completion_tokens=2)))
    assert out.text == "" and unpack_ids(out.token_ids) == [40, 41] and out.tokens == []
    assert out.finish_reason == "length" and out.usage.completion_tokens == 2


def test_echo_and_prompt_logprob_tokens_from_track(tok, view):
    prompt = ids_of(tok, "Say hi")
    track = Track(rid="r", reply_to=b"c", prompt_ids=pack_ids(prompt),
                  spec=RequestSpec(detok=DetokSpec(echo=True, token_strings=True), adapter="a"))
    st = DetokState.from_track(view, track, 0)
    first = SeqDelta(rid="r", token_ids=pack_ids(ids_of(tok, "!")), prompt_logprobs=pack_floats([-1.0] * (len(prompt) - 1)),
                     prompt_top_ids=pack_ids(prompt[1:]))
    out = st.update(first)
    assert out.prompt_text == "Say hi" and unpack_ids(out.prompt_ids) == prompt
    assert out.prompt_tokens == view.token_strings(prompt)
    assert out.prompt_top_tokens == view.token_strings(prompt[1:])
    assert out.prompt_logprobs == first.prompt_logprobs
    second = st.update(delta(ids_of(tok, "?")))
    assert second.prompt_text is None and isinstance(second, Output)
