"""What the scheduler hands the runner: the budget it plans within, the row operations the runner
executes in order, and one step's plan (its prefill pass). Pure data, no policy."""

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
    """The block store's size in tokens (`budget_tokens`: its blocks x block size) and how many rows
    of per-row state (sampling penalties, recurrent state) and how long a row may be. Memory is
    counted in blocks (the Scheduler); `fits` and `shape_for` only bound the rows and their length."""

    budget_tokens: int
    max_rows: int
    max_len: int
    row_quantum: int = 4
    cap_quantum: int = 128

    def fits(self, rows: int, cap: int) -> bool:
        return rows <= self.max_rows and cap <= self.max_len

    def shape_for(self, rows: int, cap: int, current: tuple[int, int], demand: int = 0,
                  cap_demand: int = 0) -> tuple[int, int] | None:
        """The (rows, capacity) to use for `rows` x `cap`: the current one when it is enough, else grown
        in quanta (capacity by at least a quarter; rows by at least half, and at once to `demand`, the
        rows the queued sequences will want, so a burst of arrivals costs one or two reallocations of
        the per-row state instead of one per step of admissions); None if it does not fit at all.
        Capacity grows at once to `cap_demand` (the ends of the prompts being prefilled): a long prompt
        chunked a pass at a time then costs one Resize, not one per quarter of growth (issue 30).
        A resize reallocates only the per-row state (the KV is in the block store)."""
        r0, c0 = current
        if rows > self.max_rows or cap > self.max_len:
            return None
        if rows <= r0 and cap <= c0:
            return current
        grown_r = r0 if rows <= r0 else min(self.max_rows, round_up(max(rows, demand, r0 + r0 // 2), self.row_quantum))
        grown_c = c0 if cap <= c0 else min(self.max_len, round_up(max(cap, c0 + c0 // 4), self.cap_quantum))
        if cap > c0 and cap_demand > grown_c:
            grown_c = min(self.max_len, round_up(cap_demand, self.cap_quantum))
        return (max(grown_r, rows), max(grown_c, cap))


# ------------------------------------------------------------------ what the runner executes

@dataclass(slots=True)
class Resize:
    rows: int
    capacity: int


@dataclass(slots=True)
class CopyRow:
    """Row dst's per-row state (penalties, recurrent state) := row src's (src keeps its own); the KV
    is in the sequences' block tables and is not copied."""

    src: int
    dst: int
    ntokens: int


@dataclass(slots=True)
class SwapRows:
    a: int
    b: int
    ntokens: int


@dataclass(slots=True)
class CopyBlocks:
    """Block dst := block src for each (src, dst) of the block store: the copy-on-write of an n > 1
    fork's partly filled last block (every full block is shared), and a partial prefix hit's cached block
    (Scheduler._match)."""

    pairs: list[tuple[int, int]]


@dataclass(slots=True)
class InitRow:
    """A sequence joined the running rows: per-row sampling state (penalties) starts from its tokens."""

    row: int
    seq: Sequence


RowOp = Resize | CopyRow | SwapRows | CopyBlocks | InitRow


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
