"""The n-gram (prompt lookup) proposer: the continuation of the latest earlier occurrence of a
sequence's last tokens, found in an index over its own prompt and output. No extra model.

Each sequence gets a dict from every n-gram (n in [n_min, n_max]) to the position just after its
latest occurrence, grown by the tokens added since the last call (amortized O(n_max) per token).
A lookup tries the longest suffix first; the proposal is what followed that occurrence, at most k
tokens; a match that ends less than k tokens before the end continues periodically (the suffix repeats
with period end - match).
The index covers n-grams that end before the last token, so the suffix never matches itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Index:
    length: int = 0  # tokens seen at the last call
    after: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after its latest end
    indexed: int = 0  # n-grams ending before this position are in `after`


class NGramProposer:
    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError("n-gram sizes must satisfy 1 <= n_min <= n_max")
        self.n_min = n_min
        self.n_max = n_max
        self._rows: dict[int, _Index] = {}

    def propose(self, key: int, tokens: list[int], k: int) -> list[int]:
        """At most k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (n_max down to n_min tokens long) in `tokens`; [] when there is none. `key` names the
        sequence: its index is kept between calls and extended by the tokens appended since (a
        sequence's tokens only grow; fewer than last time re-index it)."""
        if k <= 0 or len(tokens) <= self.n_min:
            return []
        idx = self._index(key, tokens)
        end = len(tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            at = idx.after.get(tuple(tokens[end - n:]))
            if at is not None:
                return _continue(tokens, at, k)
        return []

    def _index(self, key: int, tokens: list[int]) -> _Index:
        idx = self._rows.get(key)
        if idx is None or len(tokens) < idx.length:
            idx = self._rows[key] = _Index()
        idx.length = len(tokens)
        after = idx.after
        last = len(tokens) - 1  # n-grams ending at the last token stay out: the suffix would find itself
        for end in range(idx.indexed + 1, last + 1):  # an n-gram tokens[end - n:end], followed by tokens[end]
            for n in range(self.n_min, min(self.n_max, end) + 1):
                after[tuple(tokens[end - n:end])] = end
        idx.indexed = max(idx.indexed, last)
        return idx

    def forget(self, key: int) -> None:
        self._rows.pop(key, None)

    def keys(self) -> list[int]:
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def _continue(tokens: list[int], at: int, k: int) -> list[int]:
    """k tokens from position `at` on; past the end, the same period again (tokens[at:] repeated)."""
    out = tokens[at:at + k]
    period = len(tokens) - at
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
