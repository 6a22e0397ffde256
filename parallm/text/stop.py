"""Stop strings over streamed text, with hold-back so no part of a stop string is ever emitted.

Text arrives in deltas that split stop strings anywhere. The matcher keeps back the longest
suffix of what it has seen that could still grow into a stop string, and emits the rest. The
stop string that completes first wins (among several completing at the same character, the one
that starts earliest), so the result does not depend on how the text was split into deltas.
With `include_stop_str` nothing needs holding back: a prefix of a stop string is part of the
output whether or not it completes, so the text goes out at once (as vLLM does).
"""

from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Feed text deltas; get back (text safe to emit, the stop string that matched or None)."""

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        self.stops: list[str] = list(dict.fromkeys(s for s in stops if s))
        self.include_stop_str = include_stop_str
        self.matched: str | None = None
        self._held = ""
        self._seen = ""
        self._longest = max((len(s) for s in self.stops), default=0)
        self._chars = frozenset("".join(self.stops))

    @property
    def held(self) -> str:
        """Text seen but not emitted yet: a suffix that is a prefix of some stop string."""
        return self._held

    @property
    def done(self) -> bool:
        return self.matched is not None

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Take a delta. On a match, returns the text up to the stop string (or through it with
        `include_stop_str`) and the stop string; the matcher then ignores further input.

        `check=False` feeds text in which no stop string may end (vLLM's min_tokens): it is still
        kept for a stop string that starts in it and ends in a later delta.
        """
        if self.matched is not None or not text:
            return "", None
        if not self.stops:
            return text, None
        # Emitted text stays in `_seen` as context only with include_stop_str (nothing is held
        # then); without it no stop string can start in emitted text, as its start would be held.
        ctx = self._seen
        buf = ctx + self._held + text
        if check:
            hit = self._first_match(buf, len(ctx) + len(self._held))
            if hit is not None:
                start, stop = hit
                self.matched = stop
                self._held = self._seen = ""
                return buf[len(ctx):start + len(stop)] if self.include_stop_str else buf[:start], stop
        if self.include_stop_str:
            self._seen = buf[-(self._longest - 1):] if self._longest > 1 else ""
            return buf[len(ctx):], None
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """At finish without a match: the held text is ordinary output."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str, old: int) -> tuple[int, str] | None:
        """(start, stop) of the match ending first past `old` chars; earlier start breaks ties."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            i = buf.find(stop, max(0, old - len(stop) + 1))
            if i != -1:
                key = (i + len(stop), i, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        if not buf or buf[-1] not in self._chars:
            return 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops if len(s) > k):
                return k
        return 0
