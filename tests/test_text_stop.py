"""StopStringMatcher: no part of a stop string is ever emitted, however the text is split."""

from __future__ import annotations

import random

from parallm.text.stop import StopStringMatcher


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop string that completes first (ties: earliest start), on the whole text."""
    best = None
    for s in stops:
        i = text.find(s) if s else -1
        if i != -1 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[:i + len(s)] if include else text[:i], s


def run(stops, chunks, include=False):
    m = StopStringMatcher(stops, include)
    out, matched, emitted_steps = [], None, []
    for c in chunks:
        safe, hit = m.feed(c)
        out.append(safe)
        emitted_steps.append("".join(out))
        if hit is not None:
            matched = hit
            break
    if matched is None:
        out.append(m.flush())
    return "".join(out), matched, emitted_steps


def split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_random_texts_and_splits_match_the_reference():
    rng = random.Random(42)
    for _ in range(3000):
        text = "".join(rng.choice("abcab ") for _ in range(rng.randint(0, 25)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.3
        final, matched, steps = run(stops, split(rng, text), include)
        assert (final, matched) == reference(text, stops, include)
        for emitted in steps:
            assert final.startswith(emitted)               # streamed text is never taken back
            if not include:
                assert not any(s in emitted for s in stops)
        if not include and matched is None:
            # everything held back was a real prefix of a stop string and was given back at the end
            assert final == text


def test_stop_across_chunk_boundaries_never_leaks_a_prefix():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("The answer is 4<") == ("The answer is 4", None)
    assert m.held == "<"
    assert m.feed("/ans") == ("", None)
    assert m.held == "</ans"
    assert m.feed("wer> trailing") == ("", "</answer>")
    assert m.done and m.feed("more") == ("", None)


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("ORM") == ("STORM", None)
    assert m.feed("S") == ("", None)
    assert m.flush() == "S"


def test_include_stop_str_emits_through_the_stop_without_holding():
    m = StopStringMatcher(["\n\n"], include_stop_str=True)
    assert m.feed("a\n") == ("a\n", None)
    assert m.feed("\nb") == ("\n", "\n\n")


def test_earliest_completing_stop_wins():
    assert run(["world", "o w"], ["hello world"])[:2] == ("hell", "o w")
    # "bc" completes at char 3, before "abcd" at char 4, whatever the chunking
    assert run(["abcd", "bc"], ["abcd"])[:2] == ("a", "bc")
    assert run(["abcd", "bc"], ["a", "b", "c", "d"])[:2] == ("a", "bc")
    # both end at the same char: the longer (earlier-starting) one
    assert run(["bc", "abc"], ["xabc"])[:2] == ("x", "abc")


def test_stop_in_the_very_first_delta():
    m = StopStringMatcher(["Hi"])
    assert m.feed("Hi there") == ("", "Hi")


def test_unchecked_text_cannot_end_a_match_but_can_start_one():
    m = StopStringMatcher(["ab"])
    assert m.feed("xab", check=False) == ("xab", None)     # a stop ending here is ignored (min_tokens)
    assert m.feed("a", check=False) == ("", None)          # but a possible start is still held
    assert m.feed("b") == ("", "ab")


def test_no_stops_passes_everything():
    m = StopStringMatcher(["", ""])
    assert m.feed("abc") == ("abc", None)
    assert m.flush() == ""
