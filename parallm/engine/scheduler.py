"""Scheduling policy, pure Python: who gets a row, what is prefilled, who is preempted.

Rows (the index of a sequence's per-row state, cache.LiveKV): running sequences occupy rows
[0, nrun), sequences being prefilled rows [pre0, pre0 + npre), in list order (pre0 > nrun leaves a
gap rather than moving a long prefilling row: rows.py). Every change to that layout is emitted as an
ordered `RowOp` for the runner, which owns the arrays. The KV is in the block store: each sequence
holds a block table (rows.py), and memory is counted in blocks.

Row ops snapshot `num_computed` when they are emitted, so the caller must run them before
the next decode launch (the engine runs them at the start of the next step, or at once for
aborts).

Per step (docs/scheduling.md has the reasoning and the measurements):
1. rows released since the last step (finished, aborted) are compacted;
2. if the free blocks do not cover what the next passes write, the worst sequences by
   (effective priority, arrival) are preempted (row and block references freed, full blocks kept
   in the prefix cache, requeued at their arrival's place to recompute prompt + generated tokens);
3. waiting sequences are admitted by (effective priority, arrival) (priority.py) while rows,
   blocks and the prefill budget allow; a prefix-cache hit is a reference to the cached blocks;
   when the best one lacks rows or memory, a sequence of strictly worse effective priority
   is preempted for it; then every row gets the blocks its next pass writes;
4. one prefill pass over the leading rows of the prefill region (kept in priority order): the
   best priority's rows get the next chunk of their prompts, padded to one chunk length L with
   rows x L <= max_prefill_tokens, and worse rows ride along only where the budget has room;
5. one decode pass over all running rows (every step, so inter-token latency never waits for
   more than one prefill chunk).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from .admission import AdmissionPolicy, PassShape
from .blocks import BlockManager
from .pacing import PrefillPacer
from .plan import (CopyBlocks, CopyRow, InitRow, KVBudget, Plan, PrefillWork, Resize, RowOp,  # noqa: F401 - re-exported
                   SwapRows)
from .priority import PriorityPolicy, WaitingQueue
from .rows import RowLayout, blocks_for
from .sequence import SeqGroup, Sequence, Status


class Scheduler(RowLayout):
    def __init__(self, *, budget: KVBudget, max_prefill_tokens: int, blocks: BlockManager | None,
                 block_size: int, max_prefill_rows: int = 16, writeback_interval: int = 16,
                 headroom: int = 16, priority_aging_s: float = 0.0, prefill_buckets: bool = False,
                 pacer: PrefillPacer | None = None, clock: Callable[[], float] = time.monotonic,
                 prefix_cache: bool | None = None, partial_blocks: bool = False,
                 admit_delay_factor: float = 0.0) -> None:
        """`blocks`: the block store's bookkeeping (None: one of budget.budget_tokens, without prefix
        cache); `prefix_cache`: key full blocks for later hits (default: whether `blocks` was given);
        `partial_blocks`: a prompt whose next block is not cached whole starts from a copy of the cached
        block sharing most of its leading tokens (BlockManager.partial, engine.prefix_partial_blocks);
        `admit_delay_factor`: new prompts wait to fill a pass (`admission_waits`, engine.admit_delay_factor)."""
        if prefix_cache is None:
            prefix_cache = blocks is not None
        if blocks is None:
            blocks = BlockManager(budget.budget_tokens // block_size, block_size)
        super().__init__(blocks, block_size, prefix_cache, move_limit=max_prefill_tokens)
        self.budget = budget
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_rows = max_prefill_rows
        self.writeback_interval = writeback_interval  # blocks between write-backs of a long sequence
        self.headroom = headroom  # decode steps a new admission must be able to take without a grow
        self.policy = PriorityPolicy(priority_aging_s, clock)
        self.admission = AdmissionPolicy(budget=budget, max_prefill_tokens=max_prefill_tokens, headroom=headroom,
                                         priority=self.policy, buckets=prefill_buckets)
        self.pacer = pacer  # sizes each step's prefill budget to a time target (engine.prefill_pass_s)
        self.admission.memory_fits = self._fits_without
        self.waiting = WaitingQueue(self.policy)
        self._admissions = 0
        self._arrivals = 0
        self.preemptions = 0
        self.recomputed_tokens = 0  # computed tokens that preemptions threw away
        self.priority_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.partial_blocks = partial_blocks
        self.partial_hits = 0  # admissions that started from a copied partly matching block
        self._copy_sources: list[int] = []  # blocks this step's CopyBlocks read: held until ops_ran
        self.admit_delay_factor = admit_delay_factor
        self.prefill_step_s = 0.0  # the last step with a prefill pass, schedule to schedule
        self._prefill_scheduled_at: float | None = None
        self.delayed_steps = 0  # steps whose admissions waited for a fuller pass

    # ------------------------------------------------------------------ queues
    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences; n > 1 siblings wait on the leader's prefill."""
        leader = seqs[0]
        self._arrivals += 1
        now = self.policy.clock()
        for s in seqs:
            s.arrival, s.arrived_at = self._arrivals, now
        if len(seqs) > 1:
            group = SeqGroup(leader, list(seqs[1:]))
            for s in seqs:
                s.group = group
        self.waiting.push(leader)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

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

    # ------------------------------------------------------------------ the step plan
    def _pass(self, now: float) -> PassShape:
        return self.admission.pass_shape(self.prefilling, [s.prefill_remaining for s in self.prefilling], now)

    def capacity_needed(self, now: float | None = None) -> int:
        shape = self._pass(self.policy.clock() if now is None else now)
        return self.admission.capacity(self.running, [s.num_computed for s in self.prefilling], shape)

    def schedule(self) -> Plan:
        plan = Plan()
        now = self.policy.clock()
        self.ops_ran()  # the last step's, if its driver did not say so
        self._periodic_write_back()
        self._pace()
        self._order_prefilling(now)
        self._preempt_until_fits(plan, now)
        self._resize_at = len(self._pending)  # a grow goes before the admissions that write into new rows
        if self._prefill_scheduled_at is not None:
            self.prefill_step_s, self._prefill_scheduled_at = now - self._prefill_scheduled_at, None
        if self.admission_waits(now):
            self.delayed_steps += 1
        else:
            self._admit(plan, now)
        self._order_prefilling(now)
        rows = self.rows_in_use
        demand = self.row_demand() if rows > self.shape[0] else 0
        ends = max((s.prefill_target + 1 for s in self.prefilling), default=0)  # the prompts' ends, and a first token
        shape = self.budget.shape_for(rows, self.capacity_needed(now), self.shape, demand, cap_demand=ends)
        assert shape is not None, "admission/preemption left a plan that does not fit"
        self._grow(shape)
        plan.ops = self.take_ops()
        plan.prefill = self._prefill_work(now)
        if plan.prefill is not None:
            self._prefill_scheduled_at = now
        for seq in self.running:  # the blocks the passes write: each running row's next token, the prompt chunks
            self._ensure_blocks(seq, seq.num_computed + 1)
        if plan.prefill is not None:
            for seq, start, n in zip(plan.prefill.seqs, plan.prefill.starts, plan.prefill.lengths):
                self._ensure_blocks(seq, start + n)
        return plan

    def admission_waits(self, now: float) -> bool:
        """Whether this step admits nothing so that the prompts waiting fill a fuller pass: rows decode (the
        device is busy without them), no prompt is being prefilled (its pass would take them for free), less
        than a full pass waits (max_prefill_rows prompts or the pass's tokens), and the oldest waiting prompt
        arrived less than `admit_delay_factor` x the last prefill step's time ago. vLLM's
        `scheduler_delay_factor` (vllm/core/scheduler.py, `_passed_delay`), with the full pass let through at
        once. Served on a GPU, requests reach the engine spread out by the stages before it, and a pass
        admitted as each arrives has a fixed cost its few prompts do not pay for (docs/scheduling.md)."""
        if self.admit_delay_factor <= 0 or not self.running or self.prefilling or not self.waiting:
            return False
        if len(self.waiting) >= self.max_prefill_rows:
            return False
        waiting = list(self.waiting)
        if sum(s.prefill_target for s in waiting) >= self.admission.pass_tokens:
            return False
        return now - min(s.arrived_at for s in waiting) < self.admit_delay_factor * self.prefill_step_s

    def _pace(self) -> None:
        """This step's prefill budget: max_prefill_tokens, or what the pacer says a pass's prompt chunks can
        take in engine.prefill_pass_s at the prefilling rows' positions beside the running rows."""
        if self.pacer is not None:
            start = max((s.num_computed for s in self.prefilling), default=0)
            self.admission.pass_tokens = self.pacer.budget(start, [s.num_computed for s in self.running])

    # ------------------------------------------------------------------ memory, in blocks
    def blocks_ahead(self) -> int:
        """Blocks the prefilling prompts will still take (each to its end and first token): the engine grows
        the store for them at once, not by half again as each long prompt's chunks reach its end (a copy of
        every layer's store each time: 0.4-1 s a growth of a 6k-token prompt's store on the 2-core CPU)."""
        return sum(max(0, blocks_for(s.prefill_target + 1, self.block_size) - len(s.block_ids)) for s in self.prefilling)

    def fits_alone(self, tokens: int, n: int = 1) -> bool:
        """Whether a request of `tokens` positions (and n - 1 forks of it) fits the empty block store."""
        return (n <= self.budget.max_rows and tokens <= self.budget.max_len
                and blocks_for(tokens, self.block_size) + (n - 1) <= self.blocks.num_blocks)

    def _extra(self, seq: Sequence, tokens: int) -> int:
        """Blocks `seq` lacks to hold `tokens` positions."""
        return max(0, blocks_for(tokens, self.block_size) - len(seq.block_ids))

    def _available(self) -> int:
        """Blocks free or evictable (cached without a reference)."""
        return self.blocks.num_blocks - self.blocks.num_used

    def _demand(self, region: list[Sequence], rems: list[int], starts: list[int], shape: PassShape,
                skip: Sequence | None = None) -> int:
        """Blocks the next passes write beyond those held: each running row's next token, each
        prefill row in the pass its chunk and its first decode token, each row reserved for an
        n > 1 fork one (its copied or new last block)."""
        total = self.reserved + sum(self._extra(s, s.num_computed + 1) for s in self.running)
        for j in range(min(shape.k, len(region))):
            if region[j] is not skip:
                total += self._extra(region[j], starts[j] + min(rems[j], shape.length) + 1)
        return total

    def _blocks_fit(self, now: float) -> bool:
        rems = [s.prefill_remaining for s in self.prefilling]
        starts = [s.num_computed for s in self.prefilling]
        return self._demand(self.prefilling, rems, starts, self._pass(now)) <= self._available()

    def _fits_without(self, seq: Sequence, gone: list[Sequence]) -> bool:
        """Whether `seq` would fit the blocks once `gone` were preempted (a quick bound, AdmissionPolicy.victim)."""
        held: dict[int, int] = {}
        for s in gone:
            for b in s.block_ids:
                held[b] = held.get(b, 0) + 1
        freed = sum(1 for b, k in held.items() if self.blocks.blocks[b].ref_count == k)
        stay = [s for s in self.running + self.prefilling if s not in gone]
        need = sum(self._extra(s, s.num_computed + 1) for s in stay) + self.reserved
        need += blocks_for(min(seq.num_tokens + self.headroom, self.budget.max_len), self.block_size)
        return need <= self._available() + freed

    def row_demand(self) -> int:
        """Rows in use and the rows the waiting sequences want (their n > 1 siblings too): what a
        grow of the live buffer's rows should cover at once."""
        return self.rows_in_use + sum(1 + (len(s.group.followers) if s.group is not None and s.group.leader is s else 0)
                                      for s in self.waiting)

    def _grow(self, shape: tuple[int, int]) -> None:
        if shape != self.shape:
            self._pending.insert(self._resize_at, Resize(*shape))
            self.shape = shape

    def _grow_to_rows_in_use(self) -> None:
        """Before a preemption moves rows admitted in this step: make the rows they sit in exist."""
        cap = max(s.num_computed + 1 for s in self.running + self.prefilling)
        if self.pre0 + len(self.prefilling) > self.shape[0] or cap > self.shape[1]:
            shape = self.budget.shape_for(self.rows_in_use, cap, self.shape)
            assert shape is not None, "admissions left rows that do not fit"
            self._grow(shape)

    def _periodic_write_back(self) -> None:
        """Key a long-running sequence's full blocks every `writeback_interval` blocks (no copy: they
        are in the store; keying is hashing)."""
        if not self.prefix_cache or self.writeback_interval <= 0:
            return
        for s in self.running:
            valid_blocks = min(s.num_computed, s.num_tokens) // self.block_size
            if valid_blocks - s.num_keyed >= self.writeback_interval:
                self._write_back(s)

    def _order_prefilling(self, now: float) -> None:
        """Put the prefill region in priority order (stable), so that a pass's rows are its first ones."""
        if not self.policy.mixed(self.prefilling):
            return
        want = self.policy.ordered(self.prefilling, now)
        for i, seq in enumerate(want):
            j = self.prefilling.index(seq)
            if j != i:
                other = self.prefilling[i]
                self._pending.append(SwapRows(other.row, seq.row, max(other.num_computed, seq.num_computed)))
                self.prefilling[i], self.prefilling[j] = seq, other
                self._renumber_prefilling()

    def _preempt_until_fits(self, plan: Plan, now: float) -> None:
        while self.running or self.prefilling:
            if self.budget.fits(self.rows_in_use, self.capacity_needed(now)) and self._blocks_fit(now):
                return
            if self.close_gap():  # the gap's rows first
                continue
            victims = self.running + self.prefilling
            if len(victims) == 1 and not self.reserved:
                raise AssertionError("a single sequence does not fit the KV budget (admission should have refused it)")
            victim = max(victims, key=lambda s: self.policy.key(s, now))
            self.preempt(victim)
            plan.preempted.append(victim)

    def preempt(self, seq: Sequence) -> None:
        """Free the row, keep its computed full blocks in the prefix cache, requeue it at its arrival's place."""
        self._release(seq, writeback=True)
        seq.status = Status.WAITING
        self.recomputed_tokens += seq.num_computed
        seq.num_computed = 0
        seq.epoch += 1
        self.preemptions += 1
        self.waiting.push(seq)

    def _admit(self, plan: Plan, now: float) -> None:
        """Admit by (effective priority, arrival) until the best waiting sequence cannot be; if it
        lacks rows or memory, preempt worse ones for it first (`_preempt_for`)."""
        order = self.waiting.ordered(now)
        made_room: list[Sequence] = []  # preempted for a better one: not readmitted in the same step
        i = 0
        while i < len(order):
            seq = order[i]
            if seq in made_room:
                return
            blocked = self._try_admit(seq, plan, now)
            if blocked is None:
                i += 1
            elif blocked in ("rows", "memory") and self.gap:  # the gap's rows first
                self._grow_to_rows_in_use()  # rows admitted in this step may be moved: make them exist
                self.close_gap()
                self._resize_at = len(self._pending)  # a later grow (or shrink) comes after these moves
            elif self._preempt_for(seq, blocked, plan, now):
                made_room.append(plan.preempted[-1])
                order, i = self.waiting.ordered(now), 0
            else:
                return

    def _try_admit(self, seq: Sequence, plan: Plan, now: float) -> str | None:
        """Admit `seq`, or say what it lacks: "rows", "prefill_rows", "prefill" (a better prompt is
        prefilled, or it would not get a fair share of the pass) or "memory"."""
        group = seq.group if (seq.group is not None and seq.group.leader is seq) else None
        nrows = 1 + (len(group.followers) if group else 0)
        if self.rows_in_use + nrows > self.budget.max_rows:
            return "rows"
        if len(self.prefilling) + 1 > self.max_prefill_rows:
            return "prefill_rows"
        hit, part = self._match(seq)
        cached = len(hit) * self.block_size + (part[1] if part else 0)
        region, rems, starts = self.admission.with_candidate(self.prefilling, seq, seq.prefill_target - cached,
                                                             cached, now)
        shape = self.admission.pass_shape(region, rems, now)
        if self.admission.refuses_pass(region.index(seq), rems, shape):
            return "prefill"
        need = max(self.admission.capacity(self.running, starts, shape), seq.num_tokens + self.headroom)
        if not self.budget.fits(self.rows_in_use + nrows, min(need, self.budget.max_len)):
            return "memory"
        mine = region.index(seq)
        own = blocks_for(min(max(seq.num_tokens + self.headroom, starts[mine] + min(rems[mine], shape.length) + 1),
                             self.budget.max_len), self.block_size)
        own += nrows - 1 - len(hit) + sum(1 for b in hit if self.blocks.blocks[b].ref_count == 0)
        if part is not None:
            own += self.blocks.blocks[part[0]].ref_count == 0  # the copy's source is held until it ran
        if self._demand(region, rems, starts, shape, skip=seq) + own > self._available():
            return "memory"
        self.waiting.remove(seq)
        self._admissions += 1
        seq.admitted_at = self._admissions
        if seq.wants_prompt_logprobs and seq.prompt_logprobs is None:
            seq.prompt_logprobs = []
        if self.prefix_cache and seq.uses_prefix_cache:
            self.prefix_queried_tokens += seq.prefill_target
            self.prefix_hit_tokens += cached
            self.blocks.acquire(hit)
        seq.block_ids = list(hit)  # a reference: the cached blocks are the row's KV
        if part is not None:  # its first tokens copied from a cached block into one of its own
            self.blocks.acquire([part[0]])
            self._copy_sources.append(part[0])
            got = self.blocks.allocate(1)
            assert got is not None, "no block for a partial hit's copy (admission counted it)"
            self._copy_block(part[0], got[0])
            seq.block_ids.extend(got)
            self.partial_hits += 1
        seq.num_keyed, seq.chain_hash = len(hit), self.blocks.chain_hash(hit)
        seq.num_computed = cached
        if seq.num_cached_first < 0:
            seq.num_cached_first = cached
        if group is not None:
            self.reserved += len(group.followers)
        seq.status = Status.PREFILLING
        seq.row = self.pre0 + len(self.prefilling)
        self.prefilling.append(seq)
        plan.admitted.append(seq)
        return None

    def _preempt_for(self, seq: Sequence, lack: str, plan: Plan, now: float) -> bool:
        """Preempt a sequence of strictly worse effective priority for `seq`, which lacks rows
        (of the live buffer, or prefilling ones) or memory (AdmissionPolicy.victim)."""
        if lack == "prefill":
            return False
        pool = self.prefilling if lack == "prefill_rows" else self.running + self.prefilling
        victim = self.admission.victim(seq, pool, self.rows_in_use, self.running + self.prefilling, now,
                                       check_memory=lack != "prefill_rows")
        if victim is None:
            return False
        self._grow_to_rows_in_use()
        self.preempt(victim)
        self._resize_at = len(self._pending)  # a later grow (or shrink) comes after the victim's write-back
        self.priority_preemptions += 1
        plan.preempted.append(victim)
        return True

    def _match(self, seq: Sequence) -> tuple[list[int], tuple[int, int] | None]:
        """The cached full blocks `seq`'s prompt starts with, and (with partial_blocks) the cached block
        sharing most of the tokens after them with how many (at most up to its last cacheable token)."""
        if not self.prefix_cache or not seq.uses_prefix_cache:
            return [], None
        hit = self.blocks.match(seq.cache_ids, seq.adapter, seq.cacheable_tokens // self.block_size)
        if not self.partial_blocks:
            return hit, None
        start = len(hit) * self.block_size
        part = self.blocks.partial(seq.cache_ids[start:seq.cacheable_tokens], seq.adapter,
                                   self.blocks.chain_hash(hit))
        return hit, part

    def ops_ran(self) -> None:
        """The step's row ops ran: the blocks its copies read may be reused (a reference held them, so
        no allocation or disk-tier read in the same schedule could write them before the copy)."""
        if self._copy_sources:
            self.blocks.release(self._copy_sources)
            self._copy_sources = []

    def _prefill_work(self, now: float) -> PrefillWork | None:
        if not self.prefilling:
            return None
        shape = self._pass(now)
        seqs = self.prefilling[:shape.k]
        return PrefillWork(row0=self.pre0, seqs=seqs, starts=[s.num_computed for s in seqs],
                           lengths=[min(s.prefill_remaining, shape.length) for s in seqs], length=shape.padded)

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
                self._to_running(seq)
                self._pending.append(InitRow(seq.row, seq))
                self._write_back(seq)
                self._ensure_blocks(seq, seq.num_computed + 1)  # its first decode token
                self._fork(seq)
        return self.take_ops()

    def _to_running(self, seq: Sequence) -> None:
        """A prompt is done: its row becomes row nrun, the first after the running ones. At the front of
        the prefill region it is there already; across a gap (rows.py) only its own row is copied; else it
        swaps rows with the region's first."""
        j = self.prefilling.index(seq)
        if self.gap:
            self._pending.append(CopyRow(seq.row, self.nrun, seq.num_computed))
            if j == 0:
                self.prefilling.pop(0)
                self.pre0 += 1
            else:
                self._fill_from_last(j)
        else:
            if j != 0:
                first = self.prefilling[0]
                self._pending.append(SwapRows(first.row, seq.row, max(first.num_computed, seq.num_computed)))
                self.prefilling[0], self.prefilling[j] = seq, first
            self.prefilling.pop(0)
            self.pre0 += 1
        seq.row = self.nrun
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._renumber_prefilling()

    def _fork(self, leader: Sequence) -> None:
        """n > 1: the followers get rows sharing the leader's prompt blocks (copy-on-write)."""
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
            self._ensure_blocks(f, f.num_computed + 1)
        leader.group = None

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        for i, s in enumerate(self.running):
            assert s.row == i and s.status is Status.RUNNING, f"running row {i} holds {s.row}/{s.status}"
        for j, s in enumerate(self.prefilling):
            assert s.row == self.pre0 + j and s.status is Status.PREFILLING, "prefilling rows not contiguous"
            assert s.prefill_remaining > 0
        for s in self.running + self.prefilling:
            assert not s.is_finished and s.inflight <= 2 and s.num_computed <= s.num_tokens + s.inflight, s
        for s in self.waiting:
            assert s.status is Status.WAITING and s.row == -1 and not s.block_ids, "waiting sequence holds resources"
        assert self.reserved >= 0 and self.pre0 >= self.nrun
        assert self.rows_in_use <= self.budget.max_rows
        r, c = self.shape
        if self.running or self.prefilling:
            assert r >= self.rows_in_use, "more rows in use than allocated"
            assert c >= max(s.num_computed for s in self.running + self.prefilling), "a row outgrew the capacity"
        for s in self.running + self.prefilling:
            assert s.num_keyed <= len(s.block_ids)
            assert s.num_computed <= len(s.block_ids) * self.block_size, \
                f"sequence {s.seq_id} computed {s.num_computed} positions in {len(s.block_ids)} blocks"
        refs: dict[int, int] = {}
        for s in self.running + self.prefilling:
            for bid in s.block_ids:
                refs[bid] = refs.get(bid, 0) + 1
        for bid in self._copy_sources:
            refs[bid] = refs.get(bid, 0) + 1
        self.blocks.check_integrity(refs)
