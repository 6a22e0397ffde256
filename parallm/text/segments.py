"""Streamed text split into segments by markers (`<think>`, `</think>`, `<tool_call>`, ...).

The split works on decoded text, not token ids (a marker may be several tokens, or share a token
with the next byte), and holds back a tail that could be the start of a marker until the next
piece shows whether it is one, so a streamed split equals the split of the whole text.
"""

from __future__ import annotations


class MarkerSplitter:
    """`transitions[state]` = [(marker, next state), ...]; markers are consumed, not emitted."""

    def __init__(self, transitions: dict[str, list[tuple[str, str]]], state: str) -> None:
        self.transitions = {s: [(m, n) for m, n in ts if m] for s, ts in transitions.items()}
        self.state = state
        self._held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Segments (state, text) of `text`, possibly empty, in order; markers switch the state."""
        buf = self._held + text
        self._held = ""
        out: list[tuple[str, str]] = []
        while buf:
            hit = None
            for marker, nxt in self.transitions.get(self.state, ()):
                i = buf.find(marker)
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, marker, nxt)
            if hit is not None:
                i, marker, nxt = hit
                if i:
                    out.append((self.state, buf[:i]))
                buf = buf[i + len(marker):]
                self.state = nxt
                out.append((nxt, ""))  # the switch itself (a segment may end on it)
                continue
            keep = self._partial(buf)
            if keep < len(buf):
                out.append((self.state, buf[:len(buf) - keep]))
            self._held = buf[len(buf) - keep:]
            break
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of a marker of this state."""
        best = 0
        for marker, _ in self.transitions.get(self.state, ()):
            for k in range(min(len(marker) - 1, len(buf)), best, -1):
                if marker.startswith(buf[-k:]):
                    best = k
                    break
        return best

    def flush(self) -> list[tuple[str, str]]:
        """The held-back tail, as text of the current state (the stream ended)."""
        held, self._held = self._held, ""
        return [(self.state, held)] if held else []
