"""How much each row speculates: its k adapts to what it accepts, a row whose acceptance is poor
stops for a while, and the counters the engine reports (acceptance rate, mean accepted tokens, the
distribution of k).

Per row: k starts at the configured most (rounded down to a whole length, below); a verify that
accepts every proposed token raises it by one, one that rejects sets it to what was accepted plus one,
each rounded up so that the row's verify length (1 + k) is a multiple of `multiple`
(spec.verify_multiple: on the CPU a pass of 4 or 8 tokens costs less than one of 3, 5 or 7,
docs/performance.md; the tokens that round it up are more of the proposal, not padding), and at most
the configured most. The row's acceptance rate is an exponential average (weight 1/2) of accepted /
proposed; below `min_acceptance` the row rests for `backoff` steps (doubled at each rest, up to 64;
reset to 2 by a verify that accepts all).
A resting row decodes as it would without speculation, so a step whose rows all rest or have no
proposal costs what a plain step costs (free text: docs/performance.md).

N-gram mode sizes each proposal by its match instead (`ngram_k`): a match at the row's copy position
(ngram.py, `aligned`) or one spanning at least LONG_MATCH tokens proposes the most (k_top: a pass of 8
by default); a shorter unanchored match proposes PROBE_K token (a pass of 2, 1.13x a plain step on the
CPU against 1.38x for 4: a probe that pays from 13 % acceptance). Rest applies to unanchored matches
only, and only their verifies move the acceptance rate: an aligned match is a copy resuming where the
last one stopped, and is verified whatever the rate (docs/performance.md, the code edit).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MAX_BACKOFF = 64
LONG_MATCH = 4  # an unanchored n-gram match of this many tokens proposes k_top
PROBE_K = 1  # what a shorter unanchored match proposes


@dataclass(slots=True)
class _Row:
    k: int
    rate: float = 1.0
    rest: int = 0  # steps left without speculating
    backoff: int = 2


class SpecControl:
    def __init__(self, k: int, min_acceptance: float, multiple: int = 1) -> None:
        self.k_max = k
        self.min_acceptance = min_acceptance
        self.multiple = m = max(1, multiple)
        self.k_top = (k + 1) // m * m - 1 if k + 1 >= m else k  # the largest k <= spec.k of a whole length
        self._rows: dict[int, _Row] = {}
        self.verify_passes = 0  # target passes that verified proposals
        self.rows_verified = 0  # (row, pass) pairs that had a proposal
        self.proposed = 0  # tokens proposed and verified
        self.accepted = 0  # proposed tokens the target's own samples matched
        self.emitted = 0  # tokens speculating rows emitted (accepted + one each)
        self.k_counts: Counter[int] = Counter()  # proposal length -> rows verified with it

    def k(self, key: int) -> int:
        """How many tokens row `key` may propose this step (0: it rests)."""
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row(self.k_top)
        if row.rest:
            row.rest -= 1
            return 0
        return row.k

    def ngram_k(self, k: int | None, n: int, aligned: bool) -> int:
        """How many tokens an n-gram match proposes for a row whose `k()` this step was k (None: the row
        may not speculate; 0: it rests): spanning n tokens, at the row's copy position or not."""
        if k is None:
            return 0
        if aligned:
            return self.k_top
        if not k:
            return 0
        return self.k_top if n >= LONG_MATCH else min(PROBE_K, self.k_top)

    def record(self, key: int, proposed: int, accepted: int, adapt: bool = True) -> None:
        """Row `key` proposed this many tokens in a verify pass and the target accepted this many; `adapt`:
        the verify moves the row's k, acceptance rate and rest (not for an aligned n-gram match)."""
        self.rows_verified += 1
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += accepted + 1
        self.k_counts[proposed] += 1
        if not adapt:
            return
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row(self.k_top)
        row.rate = 0.5 * row.rate + 0.5 * accepted / proposed
        if accepted == proposed:
            row.k = self._fit(row.k + 1)
            row.backoff = 2
        else:
            row.k = self._fit(accepted + 1)
        if row.rate < self.min_acceptance:
            row.rest = row.backoff
            row.backoff = min(2 * row.backoff, MAX_BACKOFF)
            row.rate = self.min_acceptance  # back at the threshold: one more poor verify rests it again

    def _fit(self, k: int) -> int:
        """The least k' >= k whose verify length (1 + k') is a multiple of `multiple`, at most k_top."""
        m = self.multiple
        return max(1, min(self.k_top, -(-(k + 1) // m) * m - 1))

    def forget(self, key: int) -> None:
        self._rows.pop(key, None)

    def keys(self) -> list[int]:
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def stats(self) -> dict:
        """The counters as plain values: acceptance rate, mean accepted tokens per verified row, the k
        distribution (proposal length -> rows)."""
        return {
            "verify_passes": self.verify_passes, "rows_verified": self.rows_verified,
            "proposed_tokens": self.proposed, "accepted_tokens": self.accepted, "emitted_tokens": self.emitted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "mean_accepted_tokens": self.accepted / self.rows_verified if self.rows_verified else 0.0,
            "k_distribution": {str(k): n for k, n in sorted(self.k_counts.items())},
        }
