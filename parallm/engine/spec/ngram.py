"""The n-gram (prompt lookup) proposer: the continuation of the earlier occurrence of a sequence's last
tokens that matches the longest suffix, found in an index over its own prompt and output. No extra model.

Each sequence gets a dict from every n_min-gram to the positions just after its occurrences, grown by
the tokens added since the last call (one entry per token). A lookup takes the occurrences of the last
n_min tokens (the latest MAX_CANDIDATES of them) and extends each match backwards, up to n_max tokens;
the longest match wins, the first (earliest) occurrence among equally long ones, as vLLM's prompt lookup
picks (the text being copied is usually the prompt; a row's own output repeats what it changed, docs/
performance.md). The proposal is what followed that occurrence, at most k tokens; a match that ends less
than k tokens before the end continues periodically (the suffix repeats with period end - match).
The index covers n-grams that end before the last token, so the suffix never matches itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_CANDIDATES = 64  # occurrences of the last n_min tokens a lookup extends (the latest ones)


@dataclass(slots=True)
class _Index:
    length: int = 0  # tokens seen at the last call
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n_min-gram -> positions after it, in order
    indexed: int = 0  # n_min-grams ending before this position are in `ends`


class NGramProposer:
    def __init__(self, n_min: int = 2, n_max: int = 16) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError("n-gram sizes must satisfy 1 <= n_min <= n_max")
        self.n_min = n_min
        self.n_max = n_max
        self._rows: dict[int, _Index] = {}

    def propose(self, key: int, tokens: list[int], k: int) -> list[int]:
        """At most k tokens that followed the earlier occurrence of `tokens`' last n_min tokens whose match
        extends furthest back (up to n_max tokens; the earliest among equally long ones); [] when there is
        none. `key` names the sequence: its index is kept between calls and extended by the tokens appended
        since (a sequence's tokens only grow; fewer than last time re-index it)."""
        if k <= 0 or len(tokens) <= self.n_min:
            return []
        idx = self._index(key, tokens)
        end = len(tokens)
        found = idx.ends.get(tuple(tokens[end - self.n_min:]))
        if not found:
            return []
        best, at = 0, 0
        for a in reversed(found[-MAX_CANDIDATES:]):  # the latest first: a tie keeps the earlier
            n = self.n_min  # tokens[a - n:a] == tokens[end - n:end]
            while n < self.n_max and n < a and tokens[a - 1 - n] == tokens[end - 1 - n]:
                n += 1
            if n >= best:
                best, at = n, a
        return _continue(tokens, at, k)

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


def _continue(tokens: list[int], at: int, k: int) -> list[int]:
    """k tokens from position `at` on; past the end, the same period again (tokens[at:] repeated)."""
    out = tokens[at:at + k]
    period = len(tokens) - at
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
