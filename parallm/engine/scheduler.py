"""Scheduling policy, pure Python: who gets a row, what is prefilled, who is preempted.

Row layout of the dense live KV (see cache.LiveKV): running sequences occupy rows
[0, nrun), sequences being prefilled rows [nrun, nrun + npre), in list order. Every change
to that layout is emitted as an ordered `RowOp` for the runner, which owns the arrays.

Row ops snapshot `num_computed` when they are emitted, so the caller must run them before
the next decode launch (the engine runs them at the start of the next step, or at once for
aborts).

Per step (docs/scheduling.md has the reasoning and the measurements):
1. rows released since the last step (finished, aborted) are compacted;
2. if the live buffer cannot grow to what the next passes need, the newest admitted sequences
   are preempted (row freed, full blocks written back to the prefix cache, requeued at the
   front of the waiting queue to recompute prompt + generated tokens);
3. waiting sequences are admitted in FCFS order while rows, memory and the prefill budget allow;
   a prefix-cache hit copies the cached blocks into the new row;
4. one prefill pass: every prefilling row gets the next chunk of its prompt, all padded to one
   chunk length L with rows x L <= max_prefill_tokens;
5. one decode pass over all running rows (every step, so inter-token latency never waits for
   more than one prefill chunk).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from .blocks import BlockManager
from .sequence import SeqGroup, Sequence, Status


def round_up(x: int, q: int) -> int:
    return -(-x // q) * q


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

    def shape_for(self, rows: int, cap: int, current: tuple[int, int]) -> tuple[int, int] | None:
        """The allocation to use for `rows` x `cap`: the current one when it is enough,
        else grown in quanta (capacity by at least a quarter, so copies stay rare), else the
        tightest that fits the budget; None if even the exact need does not fit."""
        r0, c0 = current
        if rows > self.max_rows or cap > self.max_len:
            return None
        if rows <= r0 and cap <= c0:
            return current
        grown_r = r0 if rows <= r0 else min(self.max_rows, round_up(rows, self.row_quantum))
        grown_c = c0 if cap <= c0 else min(self.max_len, round_up(max(cap, c0 + c0 // 4), self.cap_quantum))
        tight_r = min(self.max_rows, round_up(rows, self.row_quantum))
        for r in dict.fromkeys((grown_r, tight_r, rows)):
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


class Scheduler:
    def __init__(self, *, budget: KVBudget, max_prefill_tokens: int, blocks: BlockManager | None,
                 block_size: int, max_prefill_rows: int = 16, writeback_interval: int = 16,
                 headroom: int = 16) -> None:
        self.budget = budget
        self.max_prefill_tokens = max_prefill_tokens
        self.blocks = blocks
        self.block_size = block_size
        self.max_prefill_rows = max_prefill_rows
        self.writeback_interval = writeback_interval  # blocks between write-backs of a long sequence
        self.headroom = headroom  # decode steps a new admission must be able to take without a grow
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.reserved = 0  # rows held for n > 1 followers until their leader's prefill is done
        self.shape = (0, 0)  # live buffer allocation (rows, capacity) as last emitted
        self._pending: list[RowOp] = []
        self._admissions = 0
        self.preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ------------------------------------------------------------------ queues
    @property
    def nrun(self) -> int:
        return len(self.running)

    @property
    def rows_in_use(self) -> int:
        return len(self.running) + len(self.prefilling) + self.reserved

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences; n > 1 siblings wait on the leader's prefill."""
        leader = seqs[0]
        if len(seqs) > 1:
            group = SeqGroup(leader, list(seqs[1:]))
            for s in seqs:
                s.group = group
        self.waiting.append(leader)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def take_ops(self) -> list[RowOp]:
        ops, self._pending = self._pending, []
        return ops

    # ------------------------------------------------------------------ releasing rows
    def finish(self, seq: Sequence, reason: str) -> None:
        """A sequence is done: write its full blocks back, release its row and blocks."""
        seq.finish_reason = reason
        self._release(seq, writeback=True)
        seq.status = Status.FINISHED

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Free the rows at once. Valid KV is still written back: aborts are mostly stop
        strings matched by the detokenizer, whose prefix a next turn will reuse."""
        for seq in seqs:
            if seq.status is Status.WAITING:
                if seq in self.waiting:
                    self.waiting.remove(seq)
            elif seq.status is not Status.FINISHED:
                self._release(seq, writeback=True)
            seq.finish_reason = "abort"
            seq.status = Status.FINISHED
            seq.epoch += 1

    def _release(self, seq: Sequence, *, writeback: bool) -> None:
        group = seq.group
        if group is not None and group.leader is seq and seq.status is not Status.WAITING:
            self.reserved -= len(group.followers)  # the followers never got their rows
        if writeback and seq.row >= 0:
            self._write_back(seq)
        if seq.status is Status.RUNNING:
            self._remove_running(seq)
        elif seq.status is Status.PREFILLING:
            self._remove_prefilling(seq)
        if self.blocks is not None and seq.block_ids:
            self.blocks.release(seq.block_ids)
        seq.block_ids = []
        seq.row = -1
        seq.inflight = 0

    def _write_back(self, seq: Sequence) -> None:
        if self.blocks is None:
            return
        valid = min(seq.num_computed, seq.num_tokens)
        nfull = valid // self.block_size
        if nfull <= len(seq.block_ids):
            return
        got = self.blocks.store(seq.block_ids, seq.token_ids, seq.adapter, nfull)
        first = len(seq.block_ids)
        seq.block_ids.extend(bid for bid, _ in got)
        # blocks already cached under the same key are shared, not copied
        new = [(first + i, bid) for i, (bid, write) in enumerate(got) if write]
        if new:
            self._pending.append(WriteBack(seq.row, new))

    def _remove_running(self, seq: Sequence) -> None:
        r, last = seq.row, self.nrun - 1
        assert self.running[r] is seq
        if r != last:
            moved = self.running[last]
            self._pending.append(CopyRow(last, r, moved.num_computed))
            self.running[r] = moved
            moved.row = r
        self.running.pop()
        if self.prefilling:  # keep the prefill region right after the running rows
            tail = self.prefilling.pop()
            self._pending.append(CopyRow(tail.row, self.nrun, tail.num_computed))
            self.prefilling.insert(0, tail)
            self._renumber_prefilling()

    def _remove_prefilling(self, seq: Sequence) -> None:
        j = self.prefilling.index(seq)
        last = len(self.prefilling) - 1
        if j != last:
            moved = self.prefilling[last]
            self._pending.append(CopyRow(moved.row, seq.row, moved.num_computed))
            self.prefilling[j] = moved
        self.prefilling.pop()
        self._renumber_prefilling()

    def _renumber_prefilling(self) -> None:
        for j, s in enumerate(self.prefilling):
            s.row = self.nrun + j

    def _insert_running(self, seq: Sequence, *, copy_from: Sequence) -> None:
        """Give `seq` the row right after the running ones (moving a prefilling row out of the
        way), fill it from another row, then start its sampling state."""
        if self.prefilling:
            first = self.prefilling.pop(0)
            self._pending.append(CopyRow(first.row, self.nrun + len(self.prefilling) + 1, first.num_computed))
            self.prefilling.append(first)
        seq.row = self.nrun
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._renumber_prefilling()
        self._pending.append(CopyRow(copy_from.row, seq.row, copy_from.num_computed))
        self._pending.append(InitRow(seq.row, seq))

    # ------------------------------------------------------------------ the step plan
    def chunk_len(self, remaining: list[int]) -> int:
        """The padded chunk length L of a prefill pass over rows with these remaining tokens."""
        if not remaining:
            return 0
        return min(max(remaining), max(1, self.max_prefill_tokens // len(remaining)))

    def _capacity(self, prefill_starts: list[int], length: int) -> int:
        """Token slots per row the next passes write: decode at num_computed; a prefill row
        writes its whole padded chunk (pad positions are overwritten later, never attended)."""
        need = max((s.num_computed + 1 for s in self.running), default=0)
        if prefill_starts:
            need = max(need, max(prefill_starts) + length + 1)
        return need

    def capacity_needed(self) -> int:
        length = self.chunk_len([s.prefill_remaining for s in self.prefilling])
        return self._capacity([s.num_computed for s in self.prefilling], length)

    def schedule(self) -> Plan:
        plan = Plan()
        self._periodic_write_back()
        self._preempt_until_fits(plan)
        admitted_ops_start = len(self._pending)
        self._admit(plan)
        rows = self.rows_in_use
        shape = self.budget.shape_for(rows, self.capacity_needed(), self.shape)
        assert shape is not None, "admission/preemption left a plan that does not fit"
        ops = self._pending
        if shape != self.shape:
            # grow before the admissions write into rows that do not exist yet
            ops.insert(admitted_ops_start, Resize(*shape))
            self.shape = shape
        plan.ops = self.take_ops()
        plan.prefill = self._prefill_work()
        return plan

    def _periodic_write_back(self) -> None:
        if self.blocks is None or self.writeback_interval <= 0:
            return
        for s in self.running:
            valid_blocks = min(s.num_computed, s.num_tokens) // self.block_size
            if valid_blocks - len(s.block_ids) >= self.writeback_interval:
                self._write_back(s)

    def _preempt_until_fits(self, plan: Plan) -> None:
        while self.running or self.prefilling:
            if self.budget.fits(self.rows_in_use, self.capacity_needed()):
                return
            victims = self.running + self.prefilling
            if len(victims) == 1 and not self.reserved:
                raise AssertionError("a single sequence does not fit the KV budget (admission should have refused it)")
            victim = max(victims, key=lambda s: s.admitted_at)
            self.preempt(victim)
            plan.preempted.append(victim)

    def preempt(self, seq: Sequence) -> None:
        """Free the row, keep its computed full blocks in the prefix cache, requeue at the front."""
        self._release(seq, writeback=True)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.epoch += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, plan: Plan) -> None:
        while self.waiting:
            seq = self.waiting[0]
            group = seq.group if (seq.group is not None and seq.group.leader is seq) else None
            nrows = 1 + (len(group.followers) if group else 0)
            if self.rows_in_use + nrows > self.budget.max_rows:
                return
            hit = self._match(seq)
            cached = len(hit) * self.block_size
            remaining = seq.prefill_target - cached
            starts = [s.num_computed for s in self.prefilling]
            rems = [s.prefill_remaining for s in self.prefilling]
            if len(rems) + 1 > self.max_prefill_rows:
                return
            length = self.chunk_len(rems + [remaining])
            # join a pass only if this row's chunk fills at least half the padded length, and
            # only if the pass's chunk stays long enough to take this prompt (or what the
            # others would get without it): more rows with shorter chunks only delay everyone
            if rems and (2 * min(remaining, length) < length
                         or length < min(remaining, self.chunk_len(rems))):
                return
            need = self._capacity(starts + [cached], length)
            need = max(need, seq.num_tokens + self.headroom)
            if not self.budget.fits(self.rows_in_use + nrows, min(need, self.budget.max_len)):
                return
            self.waiting.popleft()
            self._admissions += 1
            seq.admitted_at = self._admissions
            if seq.wants_prompt_logprobs and seq.prompt_logprobs is None:
                seq.prompt_logprobs = []
            if self.blocks is not None and seq.uses_prefix_cache:
                self.prefix_queried_tokens += seq.prefill_target
                self.prefix_hit_tokens += cached
                self.blocks.acquire(hit)
            seq.block_ids = list(hit)
            seq.num_computed = cached
            if seq.num_cached_first < 0:
                seq.num_cached_first = cached
            if group is not None:
                self.reserved += len(group.followers)
            seq.status = Status.PREFILLING
            seq.row = self.nrun + len(self.prefilling)
            self.prefilling.append(seq)
            if hit:
                self._pending.append(LoadPrefix(seq.row, list(hit)))
            plan.admitted.append(seq)

    def _match(self, seq: Sequence) -> list[int]:
        if self.blocks is None or not seq.uses_prefix_cache:
            return []
        return self.blocks.match(seq.token_ids, seq.adapter, seq.cacheable_tokens // self.block_size)

    def _prefill_work(self) -> PrefillWork | None:
        if not self.prefilling:
            return None
        length = self.chunk_len([s.prefill_remaining for s in self.prefilling])
        seqs = list(self.prefilling)
        return PrefillWork(row0=self.nrun, seqs=seqs, starts=[s.num_computed for s in seqs],
                           lengths=[min(s.prefill_remaining, length) for s in seqs], length=length)

    def complete_prefill(self, work: PrefillWork) -> list[RowOp]:
        """Account the chunks just computed; finished prompts join the running rows (and fork),
        finished prefill-only work (scores) is finished: its blocks written back, its row freed."""
        for seq, n in zip(work.seqs, work.lengths):
            if seq.status is Status.PREFILLING:
                seq.num_computed += n
        for seq in list(self.prefilling):
            if seq.status is Status.PREFILLING and seq.prefill_remaining == 0:
                if seq.prefill_only:
                    self.finish(seq, "stop")
                    continue
                j = self.prefilling.index(seq)
                if j != 0:
                    first = self.prefilling[0]
                    self._pending.append(SwapRows(first.row, seq.row, max(first.num_computed, seq.num_computed)))
                    self.prefilling[0], self.prefilling[j] = seq, first
                    self._renumber_prefilling()
                self.prefilling.pop(0)
                seq.status = Status.RUNNING
                self.running.append(seq)
                self._renumber_prefilling()
                self._pending.append(InitRow(seq.row, seq))
                self._write_back(seq)
                self._fork(seq)
        return self.take_ops()

    def _fork(self, leader: Sequence) -> None:
        """n > 1: the followers get rows holding a copy of the leader's prompt KV."""
        group = leader.group
        if group is None or group.leader is not leader:
            return
        for f in group.followers:
            self.reserved -= 1
            f.group = None
            f.num_computed = leader.num_computed
            f.num_cached_first = leader.num_cached_first
            f.prompt_logprobs = None
            self._admissions += 1
            f.admitted_at = self._admissions
            self._insert_running(f, copy_from=leader)
            if self.blocks is not None and leader.block_ids:
                self.blocks.acquire(leader.block_ids)
                f.block_ids = list(leader.block_ids)
        leader.group = None

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        for i, s in enumerate(self.running):
            assert s.row == i and s.status is Status.RUNNING, f"running row {i} holds {s.row}/{s.status}"
        for j, s in enumerate(self.prefilling):
            assert s.row == self.nrun + j and s.status is Status.PREFILLING, "prefilling rows not contiguous"
            assert s.prefill_remaining > 0
        for s in self.waiting:
            assert s.status is Status.WAITING and s.row == -1 and not s.block_ids, "waiting sequence holds resources"
        assert self.reserved >= 0
        assert self.rows_in_use <= self.budget.max_rows
        r, c = self.shape
        assert r * c <= self.budget.budget_tokens, "live buffer exceeds the KV budget"
        if self.running or self.prefilling:
            assert r >= self.rows_in_use, "more rows in use than allocated"
            assert c >= max(s.num_computed for s in self.running + self.prefilling), "a row outgrew the capacity"
        if self.blocks is not None:
            refs: dict[int, int] = {}
            for s in self.running + self.prefilling:
                for bid in s.block_ids:
                    refs[bid] = refs.get(bid, 0) + 1
            self.blocks.check_integrity(refs)
