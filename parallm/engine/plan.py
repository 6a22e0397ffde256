"""What the scheduler hands the runner: the KV budget it plans within, the row operations the
runner executes in order, and one step's plan (its prefill pass). Pure data, no policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


def round_up(x: int, q: int) -> int:
    return -(-x // q) * q


MIN_BUCKET = 16


def power_of_two_bucket(n: int, least: int, most: int) -> int:
    """`n` rounded up to a power of two, at least `least` (itself a power of two), at most `most`."""
    return min(max(least, 1 << max(0, n - 1).bit_length()), most)


def length_bucket(n: int, most: int) -> int:
    """The padded length of a prefill pass whose longest chunk is `n` tokens: the next power of two
    from MIN_BUCKET, at most `most` (the prefill budget, itself the top bucket) and never below `n`,
    so the passes of a run take a handful of shapes (engine.prefill_buckets)."""
    return max(n, power_of_two_bucket(n, MIN_BUCKET, most))


def length_buckets(most: int) -> list[int]:
    """Every length `length_bucket` gives for chunks of 1 .. `most` tokens."""
    return sorted({length_bucket(n, most) for n in [1] + [1 << e for e in range(most.bit_length() + 1)] + [most]
                   if n <= most})


@dataclass(frozen=True, slots=True)
class KVBudget:
    """How large the dense live buffer (rows x capacity token slots) may be."""

    budget_tokens: int
    max_rows: int
    max_len: int
    row_quantum: int = 4
    cap_quantum: int = 128

    def fits(self, rows: int, cap: int) -> bool:
        return rows * cap <= self.budget_tokens and rows <= self.max_rows and cap <= self.max_len

    def shape_for(self, rows: int, cap: int, current: tuple[int, int], demand: int = 0,
                  cap_demand: int = 0) -> tuple[int, int] | None:
        """The allocation to use for `rows` x `cap`: the current one when it is enough, else grown
        in quanta (capacity by at least a quarter; rows by at least half, and at once to `demand`,
        the rows the queued sequences will want, so a burst of arrivals costs one or two copies of
        the buffer instead of one per step of admissions), else as many of those rows as the budget
        allows, else the tightest that fits; None if even the exact need does not fit. Capacity
        grows at once to `cap_demand` (the ends of the prompts being prefilled) when that fits the
        budget with the grown rows: a long prompt chunked a pass at a time then costs one copy of the
        buffer while it is small, not one per quarter of growth (a 6k-token prompt of the default
        model on the CPU: 13 copies, the last ones 1.3-2.9 s each inside a step, issue 30).

        Every resize allocates a new buffer and copies the old one, which MLX keeps in its buffer
        cache at its own size: growing 256 rows four at a time churned ~190 GB through the cache
        for the Qwen3-30B-A3B shape (docs/scheduling.md, "Growing the live buffer")."""
        r0, c0 = current
        if rows > self.max_rows or cap > self.max_len:
            return None
        if rows <= r0 and cap <= c0:
            return current
        grown_r = r0 if rows <= r0 else min(self.max_rows, round_up(max(rows, demand, r0 + r0 // 2), self.row_quantum))
        grown_c = c0 if cap <= c0 else min(self.max_len, round_up(max(cap, c0 + c0 // 4), self.cap_quantum))
        if cap > c0 and cap_demand > grown_c:
            wanted = min(self.max_len, round_up(cap_demand, self.cap_quantum))
            if grown_r * wanted <= self.budget_tokens:
                grown_c = wanted
        tight_r = min(self.max_rows, round_up(rows, self.row_quantum))
        fit_r = min(grown_r, self.budget_tokens // max(1, cap) // self.row_quantum * self.row_quantum)  # as many as fit
        for r in dict.fromkeys((grown_r, fit_r, tight_r, rows)):
            if r < rows:
                continue
            # the grown capacity, or as much of it as the budget allows with r rows
            c = min(grown_c, self.budget_tokens // r)
            if c >= cap:
                return (r, c)
        return None


# ------------------------------------------------------------------ what the runner executes

@dataclass(slots=True)
class Resize:
    rows: int
    capacity: int


@dataclass(slots=True)
class CopyRow:
    """Copy positions [0, ntokens) of row src into row dst (src keeps its content)."""

    src: int
    dst: int
    ntokens: int


@dataclass(slots=True)
class SwapRows:
    a: int
    b: int
    ntokens: int


@dataclass(slots=True)
class LoadPrefix:
    """Copy cached blocks into positions [0, len(block_ids) * block_size) of a row."""

    row: int
    block_ids: list[int]


@dataclass(slots=True)
class WriteBack:
    """Copy full blocks of a row into the prefix pool: (block index in the row, pool block id)."""

    row: int
    blocks: list[tuple[int, int]]


@dataclass(slots=True)
class InitRow:
    """A sequence joined the running rows: per-row sampling state (penalties) starts from its tokens."""

    row: int
    seq: Sequence


RowOp = Resize | CopyRow | SwapRows | LoadPrefix | WriteBack | InitRow


@dataclass(slots=True)
class PrefillWork:
    """One prefill pass: rows [row0, row0 + len(seqs)), chunk i = positions starts[i] .. + lengths[i]."""

    row0: int
    seqs: list[Sequence]
    starts: list[int]
    lengths: list[int]
    length: int  # L: every row is padded to it


@dataclass(slots=True)
class Plan:
    ops: list[RowOp] = field(default_factory=list)
    prefill: PrefillWork | None = None
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
