"""IncrementalDetokenizer: deltas concatenate to the full decode, never split a character."""

from __future__ import annotations

import random

import pytest
from text_tokenizers import byte_bpe, byte_token, metaspace_bpe, random_text, raw_byte_bpe

from parallm.text.detokenize import MAX_HELD, IncrementalDetokenizer
from parallm.text.vocab import TokenizerView, token_string_bytes

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return byte_bpe()


@pytest.fixture(scope="module")
def view(tok):
    return TokenizerView(tok)


def stream(view, prompt, gen, skip):
    detok = IncrementalDetokenizer(view, prompt, skip)
    deltas = [detok.add(t) for t in gen]
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("skip", [True, False])
def test_random_unicode_text_round_trips(tok, view, skip):
    rng = random.Random(1234 + skip)
    specials = [tok.convert_tokens_to_ids(s) for s in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")]
    for _ in range(400):
        prompt = tok.encode(random_text(rng, 20), add_special_tokens=False)
        gen = tok.encode(random_text(rng, 60), add_special_tokens=False)
        for _ in range(rng.randint(0, 2)):  # special tokens anywhere, also between split bytes
            gen.insert(rng.randint(0, len(gen)), rng.choice(specials))
        full = tok.decode(gen, skip_special_tokens=skip)
        deltas, _ = stream(view, prompt, gen, skip)
        assert "".join(deltas) == full
        if FFFD not in full:
            assert not any(FFFD in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_arbitrary_id_streams_round_trip(tok, view, skip):
    """A model can emit any id sequence, invalid UTF-8 included: still equal to decode()."""
    rng = random.Random(99 + skip)
    for _ in range(300):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        gen = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 50))]
        deltas, _ = stream(view, prompt, gen, skip)
        assert "".join(deltas) == tok.decode(gen, skip_special_tokens=skip)


def test_character_split_over_tokens_is_held_until_complete(tok, view):
    emoji = "😀".encode()
    detok = IncrementalDetokenizer(view, tok.encode("hi"), True)
    assert [detok.add(byte_token(tok, b)) for b in emoji] == ["", "", "", "😀"]
    assert detok.add(tok.encode("!")[0]) == "!"
    assert detok.flush() == ""


def test_incomplete_character_at_finish_is_flushed_as_replacement(tok, view):
    detok = IncrementalDetokenizer(view, [], True)
    assert detok.add(tok.encode("a")[0]) == "a"
    assert detok.add(byte_token(tok, 0xE2)) == ""
    assert detok.add(byte_token(tok, 0x82)) == ""
    assert detok.flush() == FFFD
    assert detok.flush() == ""


def test_prompt_ending_mid_character_does_not_lend_its_bytes(tok, view):
    euro = "€".encode()
    prompt = tok.encode("x", add_special_tokens=False) + [byte_token(tok, euro[0])]
    gen = [byte_token(tok, b) for b in euro[1:]] + tok.encode("ok", add_special_tokens=False)
    deltas, _ = stream(view, prompt, gen, True)
    assert "".join(deltas) == tok.decode(gen) == FFFD * 2 + "ok"


def test_garbage_bytes_keep_the_window_bounded(tok, view):
    """A stream of lone lead bytes keeps ending in U+FFFD; the safety valve bounds the work."""
    rng = random.Random(5)
    gen = [byte_token(tok, rng.choice([0xE2, 0xF0, 0xC3])) for _ in range(500)]
    gen += [byte_token(tok, b) for b in "€".encode()]
    detok = IncrementalDetokenizer(view, [], True)
    deltas = []
    for t in gen:
        deltas.append(detok.add(t))
        assert detok.held_tokens <= MAX_HELD + 1
        assert len(detok._ids) <= 2 * MAX_HELD + 2
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(gen)
    assert "".join(deltas).endswith("€")


def test_window_stays_small_on_long_generations(tok, view):
    rng = random.Random(7)
    gen = tok.encode(" ".join(random_text(rng) for _ in range(200)), add_special_tokens=False)
    assert len(gen) > 2000
    detok = IncrementalDetokenizer(view, [], False)
    out = []
    for t in gen:
        out.append(detok.add(t))
        assert len(detok._ids) <= 12
    assert "".join(out) + detok.flush() == tok.decode(gen)


def test_raw_tokenizers_object_is_accepted():
    raw = raw_byte_bpe()
    ids = raw.encode("naïve 你好 😀").ids
    deltas, _ = stream(raw, [], ids, True)
    assert "".join(deltas) == "naïve 你好 😀"


def test_metaspace_keeps_the_leading_space_from_prompt_context():
    """vLLM semantics: the first generated '▁world' streams as ' world' after a prompt."""
    raw = metaspace_bpe()
    prompt = [1]                      # "▁Hello"
    gen = [2, 4, 6 + 0xE2, 6 + 0x82, 6 + 0xAC]   # ▁world ! then € as byte-fallback tokens
    deltas, _ = stream(raw, prompt, gen, True)
    assert deltas[0] == " world"
    assert "".join(deltas) == " world!€"
    assert "".join(deltas) == raw.decode(prompt + gen)[len(raw.decode(prompt)):]
    deltas, _ = stream(raw, [], gen, True)       # no prompt: the space goes, as decode() does
    assert "".join(deltas) == raw.decode(gen) == "world!€"


# --------------------------------------------------------------------------- token strings

def test_token_strings_and_bytes(tok, view):
    emoji = "😀".encode()
    partial = byte_token(tok, emoji[0])
    assert view.token_string(partial) == "bytes:\\xf0"
    assert token_string_bytes(view.token_string(partial)) == [0xF0]
    for text in ("hello", " world", "é", "你"):
        for i in tok.encode(text, add_special_tokens=False):
            s = view.token_string(i)
            assert token_string_bytes(s) == list(view.token_bytes(i))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert view.token_string(im_end) == "<|im_end|>"
    # bytes of every token concatenated are the bytes of the text
    ids = tok.encode("naïve 你好 😀 👍🏽", add_special_tokens=False)
    assert b"".join(bytes(token_string_bytes(view.token_string(i))) for i in ids) == "naïve 你好 😀 👍🏽".encode()
    assert view.token_string(10**6) == ""


def test_token_strings_sentencepiece_style():
    view = TokenizerView(metaspace_bpe())
    assert view.token_strings([1, 3, 4]) == [" Hello", "Hello", "!"]
    assert view.token_string(6 + 0xE2) == "bytes:\\xe2"
    assert view.token_string(6 + ord("a")) == "a"
    assert view.token_string(262) == "</s>"
