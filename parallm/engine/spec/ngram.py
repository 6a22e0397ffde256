"""The n-gram (prompt lookup) proposer: the continuation of an earlier occurrence of a sequence's last
tokens, found in an index over its own prompt and output. No extra model.

Each sequence gets a dict from every n_min-gram to the positions just after its occurrences, grown by
the tokens added since the last call (one entry per token). A lookup takes the occurrences of the last
n_min tokens (the latest MAX_CANDIDATES of them) and extends each match backwards, up to n_max tokens;
the longest match wins, the first (earliest) occurrence among equally long ones, as vLLM's prompt lookup
picks (the text being copied is usually the prompt; a row's own output repeats what it changed, docs/
performance.md). The proposal is what followed that occurrence, at most k tokens; a match that ends less
than k tokens before the end continues periodically (the suffix repeats with period end - match).
The index covers n-grams that end before the last token, so the suffix never matches itself.

The copy position. A row that copies with edits (a code edit renames a variable; an extraction skips
a line) resumes copying near where its last accepted run stopped, not where the longest match of its
last tokens happens to be. So each sequence keeps the position after the text its last accepted
proposal copied (`accepted`); a lookup first looks for an occurrence of the last token alone within
ALIGN_WINDOW positions after it (from one before: the model may have replaced the token there) and
takes the nearest (the longer match of equally near ones). Such a match is `aligned`: the controller
trusts it more than an unanchored one (control.py). Measured on the code edit (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_CANDIDATES = 64  # occurrences of the last n_min tokens a lookup extends (the latest ones)
ALIGN_WINDOW = 8  # how far past the copy position an aligned match may start


@dataclass(slots=True)
class _Index:
    length: int = 0  # tokens seen at the last call
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n_min-gram -> positions after it, in order
    indexed: int = 0  # n_min-grams ending before this position are in `ends`
    copy: int | None = None  # the position after the text the last accepted proposal copied


@dataclass(frozen=True, slots=True)
class Match:
    """An earlier occurrence of a sequence's last tokens: the proposal is what follows position `at`;
    `n`: how many tokens the match spans; `aligned`: it starts at the sequence's copy position."""

    at: int
    n: int
    aligned: bool


class NGramProposer:
    def __init__(self, n_min: int = 2, n_max: int = 16) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError("n-gram sizes must satisfy 1 <= n_min <= n_max")
        self.n_min = n_min
        self.n_max = n_max
        self._rows: dict[int, _Index] = {}

    def propose(self, key: int, tokens: list[int], k: int) -> list[int]:
        """At most k tokens that followed the match `lookup` finds; [] when there is none."""
        if k <= 0:
            return []
        match = self.lookup(key, tokens)
        return [] if match is None else continuation(tokens, match, k)

    def lookup(self, key: int, tokens: list[int]) -> Match | None:
        """The occurrence to copy from: an aligned one (the last token near the copy position) if there
        is one, else of the occurrences of the last n_min tokens the one whose match extends furthest back
        (up to n_max tokens; the earliest among equally long ones); None when there is none. `key` names the
        sequence: its index is kept between calls and extended by the tokens appended since (a sequence's
        tokens only grow; fewer than last time re-index it)."""
        if len(tokens) <= self.n_min:
            return None
        idx = self._index(key, tokens)
        aligned = self._aligned(idx, tokens)
        if aligned is not None:
            return aligned
        end = len(tokens)
        found = idx.ends.get(tuple(tokens[end - self.n_min:]))
        if not found:
            return None
        best, at = 0, 0
        for a in reversed(found[-MAX_CANDIDATES:]):  # the latest first: a tie keeps the earlier
            n = self._extend(tokens, a, self.n_min)
            if n >= best:
                best, at = n, a
        return Match(at, best, False)

    def accepted(self, key: int, match: Match, accepted: int) -> None:
        """A proposal copied from `match` had its first `accepted` tokens accepted: the copy position moves
        past them (and past the token the row emitted after them, which replaced or repeated the next)."""
        idx = self._rows.get(key)
        if idx is not None and accepted > 0:
            idx.copy = match.at + accepted + 1

    def _aligned(self, idx: _Index, tokens: list[int]) -> Match | None:
        if idx.copy is None:
            return None
        end, last = len(tokens), tokens[-1]
        best: Match | None = None
        for a in range(max(1, idx.copy - 1), min(end, idx.copy + ALIGN_WINDOW + 1)):  # a < end: never itself
            if tokens[a - 1] != last:
                continue
            near = abs(a - idx.copy)
            if best is not None and near > abs(best.at - idx.copy):
                break
            n = self._extend(tokens, a, 1)
            if best is None or near < abs(best.at - idx.copy) or n > best.n:
                best = Match(a, n, True)
        return best

    def _extend(self, tokens: list[int], a: int, n: int) -> int:
        """How far back the match of tokens[a - n:a] with the sequence's last n tokens extends (<= n_max)."""
        end = len(tokens)
        while n < self.n_max and n < a and tokens[a - 1 - n] == tokens[end - 1 - n]:
            n += 1
        return n

    def _index(self, key: int, tokens: list[int]) -> _Index:
        idx = self._rows.get(key)
        if idx is None or len(tokens) < idx.length:
            idx = self._rows[key] = _Index()
        idx.length = len(tokens)
        ends, n = idx.ends, self.n_min
        last = len(tokens) - 1  # n-grams ending at the last token stay out: the suffix would find itself
        for end in range(max(idx.indexed + 1, n), last + 1):  # tokens[end - n:end], followed by tokens[end]
            ends.setdefault(tuple(tokens[end - n:end]), []).append(end)
        idx.indexed = max(idx.indexed, last)
        return idx

    def forget(self, key: int) -> None:
        self._rows.pop(key, None)

    def keys(self) -> list[int]:
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def continuation(tokens: list[int], match: Match, k: int) -> list[int]:
    """k tokens from position `match.at` on; past the end, the same period again (tokens[at:] repeated)."""
    at = match.at
    out = tokens[at:at + k]
    period = len(tokens) - at
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
