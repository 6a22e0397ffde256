"""Scheduler policy without a model: a fake runner replays the row operations and the passes on a
block store of token lists, so every sequence's content, read through its block table, can be
checked against the sequence it belongs to."""

import random

import pytest

from parallm.engine.blocks import BlockManager
from parallm.engine.scheduler import CopyBlocks, CopyRow, InitRow, KVBudget, Resize, Scheduler, SwapRows
from parallm.engine.sequence import Sequence, Status
from parallm.protocol import SamplingParams

PAD = -1


class FakeRunner:
    """The block store as token lists: slot t of block b "holds the KV" of token store[b][t]."""

    def __init__(self, blocks: BlockManager | None, block_size: int) -> None:
        self.blocks = blocks
        self.store: dict[int, list[int]] = {}
        self.rows = 0
        self.capacity = 0
        self.bs = block_size
        self.resizes = 0
        self.copied_blocks = 0

    def execute(self, ops):
        for op in ops:
            if isinstance(op, Resize):
                self.resizes += 1
                self.rows, self.capacity = op.rows, op.capacity
            elif isinstance(op, CopyBlocks):
                for src, dst in op.pairs:
                    self.store[dst] = list(self.store[src])
                    self.copied_blocks += 1
            elif isinstance(op, (CopyRow, SwapRows, InitRow)):
                pass  # per-row state only: the KV moves with the block tables
            else:
                raise TypeError(op)

    def write(self, seq, pos: int, token: int, *, pad: bool = False) -> None:
        j = pos // self.bs
        if j >= len(seq.block_ids):
            assert pad, f"seq {seq.seq_id} writes position {pos} past its {len(seq.block_ids)} blocks"
            return  # the trash block
        bid = seq.block_ids[j]
        if self.blocks is not None:
            blk = self.blocks.blocks[bid]
            assert blk.ref_count == 1 and blk.hash == -1, f"seq {seq.seq_id} writes into shared/keyed block {bid}"
        self.store.setdefault(bid, [PAD] * self.bs)[pos % self.bs] = token

    def read(self, seq, n: int) -> list[int]:
        return [self.store.get(seq.block_ids[p // self.bs], [PAD] * self.bs)[p % self.bs] for p in range(n)]

    def prefill(self, work):
        for seq, start, n in zip(work.seqs, work.starts, work.lengths):
            for p in range(start, start + work.length):
                self.write(seq, p, seq.token_ids[p] if p < start + n else PAD, pad=p >= start + n)

    def decode(self, seqs):
        for i, s in enumerate(seqs):
            assert s.row == i
            assert s.num_computed == s.num_tokens - 1
            assert s.num_computed < self.capacity, "decode writes past the capacity"
            self.write(s, s.num_computed, s.token_ids[s.num_computed])


def check_rows(sched: Scheduler, runner: FakeRunner, block_size: int):
    for s in sched.running + sched.prefilling:
        assert runner.read(s, s.num_computed) == s.token_ids[:s.num_computed], f"row {s.row} of seq {s.seq_id}"
    for bid, blk in enumerate(sched.blocks.blocks):
        if blk.hash != -1:
            assert tuple(runner.store[bid]) == blk.token_ids, f"keyed block {bid} content"
    r, c = sched.shape
    assert (runner.rows, runner.capacity) == (r, c)


def simulate(seed: int, *, budget_tokens: int, n_requests: int = 30, max_rows: int = 8, prefill_budget: int = 24,
             pool_blocks: int = 32, block_size: int = 4, abort_rate: float = 0.02, shared_prefix: bool = True,
             priorities: tuple[int, ...] = (0,), aging_s: float = 0.0, admit_delay_factor: float = 0.0):
    rng = random.Random(seed)
    clock = [0.0]
    blocks = BlockManager(budget_tokens // block_size, block_size, max_cached=pool_blocks) if pool_blocks else None
    budget = KVBudget(budget_tokens=budget_tokens, max_rows=max_rows, max_len=200 + prefill_budget + 1,
                      row_quantum=2, cap_quantum=8)
    sched = Scheduler(budget=budget, max_prefill_tokens=prefill_budget, blocks=blocks, block_size=block_size,
                      max_prefill_rows=4, writeback_interval=2, headroom=4, priority_aging_s=aging_s,
                      clock=lambda: clock[0], admit_delay_factor=admit_delay_factor)
    runner = FakeRunner(sched.blocks, block_size)
    base = [rng.randrange(50) for _ in range(40)]
    seqs_by_req = []
    next_id = 0
    pending = list(range(n_requests))
    finished = []
    step = 0
    while pending or sched.has_work():
        # arrivals
        while pending and rng.random() < 0.4:
            i = pending.pop(0)
            plen = rng.randrange(1, 40)
            prompt = (base[:rng.randrange(0, 30)] if shared_prefix else []) + [rng.randrange(50) for _ in range(plen)]
            n = rng.choice([1, 1, 1, 2, 3])
            max_tokens = rng.randrange(1, 25)
            priority = rng.choice(priorities)
            group = []
            for j in range(n):
                next_id += 1
                group.append(Sequence(seq_id=next_id, rid=f"r{i}", index=j, prompt_ids=list(prompt),
                                      params=SamplingParams(max_tokens=max_tokens), seed=0, priority=priority))
            if not sched.fits_alone(len(prompt) + max_tokens + 1) or not sched.fits_alone(len(prompt) + 4, n):
                continue  # the engine would reject it
            seqs_by_req.append(group)
            sched.add(group)
        plan = sched.schedule()
        runner.execute(plan.ops)
        check_rows(sched, runner, block_size)
        if plan.prefill:
            work = plan.prefill
            runner.prefill(work)
            # as the engine does: a prompt that ends in this pass samples its first token from it
            # (and so do its n > 1 siblings), the rows join, then who finished is released
            first = [f for seq, start, n in zip(work.seqs, work.starts, work.lengths)
                     if n and start + n == seq.prefill_target
                     for f in [seq] + (seq.group.followers if seq.group and seq.group.leader is seq else [])]
            ops = sched.complete_prefill(work)
            for f in first:
                f.output_ids.append(rng.randrange(50))
            runner.execute(ops)
            for f in first:
                if f.num_output >= f.params.max_tokens:
                    sched.finish(f, "length")
                    finished.append(f)
            runner.execute(sched.take_ops())
            check_rows(sched, runner, block_size)
        seqs = list(sched.running)
        runner.decode(seqs)
        for s in seqs:  # as the engine does: every launched row advances, then results are read
            s.num_computed += 1
        for s in seqs:
            s.output_ids.append(rng.randrange(50))
            if s.num_output >= s.params.max_tokens or rng.random() < 0.03:
                sched.finish(s, "length")
                finished.append(s)
        runner.execute(sched.take_ops())  # the engine runs these at the start of the next step
        if rng.random() < abort_rate:
            live = [g for g in seqs_by_req if any(not s.is_finished for s in g)]
            if live:
                g = rng.choice(live)
                sched.abort([s for s in g if not s.is_finished])
                runner.execute(sched.take_ops())
        sched.check_integrity()
        check_rows(sched, runner, block_size)
        clock[0] += 0.1
        step += 1
        assert step < 5000, "scheduler made no progress"
    for g in seqs_by_req:
        for s in g:
            assert s.is_finished
            if s.finish_reason != "abort":
                assert s.num_output >= 1
    assert sched.rows_in_use == 0 and sched.reserved == 0
    if blocks is not None:
        assert blocks.num_used == 0
    return sched, runner


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_roomy(seed):
    sched, _ = simulate(seed, budget_tokens=4000)
    assert sched.preemptions == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_tight_memory_preempt(seed):
    sched, _ = simulate(seed, budget_tokens=120, pool_blocks=8)
    assert sched.preemptions > 0


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_without_prefix_cache(seed):
    simulate(seed, budget_tokens=200, pool_blocks=0)


@pytest.mark.parametrize("aging_s", [0.0, 0.5])
def test_random_workloads_with_priorities(aging_s):
    """Admission, preemption and passes by priority keep every row's content and every block
    reference right, with rows or memory short, with and without aging."""
    made_room = 0
    for seed in range(12):
        for kw in (dict(budget_tokens=4000, n_requests=40, max_rows=4), dict(budget_tokens=120, pool_blocks=8),
                   dict(budget_tokens=300, pool_blocks=16, max_rows=6)):
            sched, _ = simulate(seed, priorities=(-1, 0, 3), aging_s=aging_s, **kw)
            made_room += sched.priority_preemptions
    assert made_room > 20


def test_prefix_hit_counts_and_never_covers_the_last_token():
    blocks = BlockManager(16, 4)
    budget = KVBudget(budget_tokens=1000, max_rows=4, max_len=100)
    sched = Scheduler(budget=budget, max_prefill_tokens=64, blocks=blocks, block_size=4)
    runner = FakeRunner(blocks, 4)
    prompt = list(range(16))  # exactly 4 blocks
    a = Sequence(seq_id=1, rid="a", index=0, prompt_ids=prompt, params=SamplingParams(), seed=0)
    sched.add([a])
    plan = sched.schedule()
    runner.execute(plan.ops)
    runner.prefill(plan.prefill)
    runner.execute(sched.complete_prefill(plan.prefill))
    assert a.status is Status.RUNNING and a.num_computed == 16  # every prompt token: the last gives the logits
    assert a.num_keyed == 4  # 16 computed tokens: 4 full blocks keyed (no copy: they are the row's)
    b = Sequence(seq_id=2, rid="b", index=0, prompt_ids=prompt, params=SamplingParams(), seed=0)
    sched.add([b])
    plan = sched.schedule()
    runner.execute(plan.ops)
    # 12 of 16 prefill tokens come from the cache: the block holding the last prompt token is
    # recomputed, since prefill samples the first output token from that token's logits
    assert sched.prefix_hit_tokens == 12 and b.num_computed == 12 and b.num_cached_first == 12
    assert plan.prefill is not None and plan.prefill.lengths[plan.prefill.seqs.index(b)] == 4
    check_rows(sched, runner, 4)
    sched.check_integrity()


def test_prefill_chunks_respect_budget_and_padding_rule():
    budget = KVBudget(budget_tokens=10_000, max_rows=16, max_len=1000)
    sched = Scheduler(budget=budget, max_prefill_tokens=64, blocks=None, block_size=16)
    seqs = [Sequence(seq_id=i, rid=str(i), index=0, prompt_ids=[1] * n, params=SamplingParams(), seed=0)
            for i, n in enumerate([200, 6, 20, 20])]
    for s in seqs:
        sched.add([s])
    plan = sched.schedule()
    # two rows pad the 6-token chunk to 32, more than half padding, but it finishes in this pass beside a
    # long prompt being chunked (fair prefill: it would wait for all 200 tokens otherwise); one 20-token
    # prompt joins as well (its chunk is not mostly padding), a second would cut every chunk below 20
    assert [s.seq_id for s in plan.prefill.seqs] == [0, 1, 2]
    assert plan.prefill.length == 21 and plan.prefill.lengths == [21, 6, 20]
    sched3 = Scheduler(budget=budget, max_prefill_tokens=64, blocks=None, block_size=16)
    for i, n in enumerate([200, 20, 20, 20]):
        sched3.add([Sequence(seq_id=i, rid=str(i), index=0, prompt_ids=[1] * n, params=SamplingParams(), seed=0)])
    plan = sched3.schedule()
    # chunks of similar size share the pass: the long prompt gives up part of its chunk so
    # that two short prompts finish in this pass; a third would cut every chunk below 20
    assert len(plan.prefill.seqs) == 3 and plan.prefill.length == 21
    assert plan.prefill.lengths == [21, 20, 20]
    sched2 = Scheduler(budget=budget, max_prefill_tokens=64, blocks=None, block_size=16)
    for s in [Sequence(seq_id=i, rid=str(i), index=0, prompt_ids=[1] * 17, params=SamplingParams(), seed=0)
              for i in range(6)]:
        sched2.add([s])
    plan = sched2.schedule()
    assert len(plan.prefill.seqs) * plan.prefill.length <= 64
    assert len(plan.prefill.seqs) == 3 and plan.prefill.length == 17  # a fourth would cut every prompt


def test_short_prompts_start_while_a_long_one_is_chunked():
    """Issue 30: one uncached 6k-token prompt held every new request for 63 s on a CPU: each of its chunks
    took the whole prefill budget, and a short prompt, mostly padding beside it, never joined a pass. Now
    each pass takes one short prompt beside it, which then decodes, and the long prompt keeps at least half
    the budget."""
    budget = KVBudget(budget_tokens=100_000, max_rows=16, max_len=8000)
    sched = Scheduler(budget=budget, max_prefill_tokens=128, blocks=None, block_size=16)
    runner = FakeRunner(sched.blocks, 16)
    long = Sequence(seq_id=0, rid="long", index=0, prompt_ids=[1] * 6000, params=SamplingParams(), seed=0)
    sched.add([long])
    started, long_chunks = {}, []
    for step in range(20):
        if step % 2 == 0 and step < 12:  # a short request every other step
            sched.add([Sequence(seq_id=100 + step, rid=f"s{step}", index=0, prompt_ids=[1] * 8,
                                params=SamplingParams(), seed=0)])
        plan = sched.schedule()
        runner.execute(plan.ops)
        runner.prefill(plan.prefill)
        long_chunks += [n for s, n in zip(plan.prefill.seqs, plan.prefill.lengths) if s is long]
        runner.execute(sched.complete_prefill(plan.prefill))
        for s in sched.running:
            started.setdefault(s.rid, step)
    assert {f"s{i}": started[f"s{i}"] for i in range(0, 12, 2)} == {f"s{i}": i for i in range(0, 12, 2)}
    assert min(long_chunks) >= 64 and long.status is Status.PREFILLING
    sched.check_integrity()


def passing_a_long_prefill(move_limit: int | None = None) -> tuple[list[int], dict[str, int], Scheduler, list[Resize]]:
    """A 6,000-token prompt chunked 128 tokens a pass while short requests come one after another, each
    finishing after its second token (the isolation bench's canary). Returns the positions each step's row
    ops copied (a swap counts both rows), the steps each short request took, the scheduler and its resizes."""
    budget = KVBudget(budget_tokens=100_000, max_rows=16, max_len=8000)
    sched = Scheduler(budget=budget, max_prefill_tokens=128, blocks=BlockManager(100_000 // 16, 16), block_size=16)
    if move_limit is not None:
        sched.move_limit = move_limit
    runner = FakeRunner(sched.blocks, 16)
    long = Sequence(seq_id=0, rid="long", index=0, prompt_ids=[(7 * i) % 50 + 1 for i in range(6000)],
                    params=SamplingParams(max_tokens=1), seed=0)
    sched.add([long])
    copied, steps, arrived, short, resizes = [], {}, {}, None, []
    for step in range(200):
        if short is None and long.status is Status.PREFILLING:
            short = Sequence(seq_id=100 + step, rid=f"s{step}", index=0, prompt_ids=[3, 4, step % 40 + 5],
                             params=SamplingParams(max_tokens=2), seed=0)
            sched.add([short])
            arrived[short.rid] = step
        plan = sched.schedule()
        ops = list(plan.ops)
        runner.execute(plan.ops)
        work = plan.prefill
        runner.prefill(work)
        done = [seq for seq, start, n in zip(work.seqs, work.starts, work.lengths) if start + n == seq.prefill_target]
        ops += (more := sched.complete_prefill(work))
        runner.execute(more)
        for seq in done:  # its first token, from the prefill pass
            seq.output_ids.append(9)
        seqs = list(sched.running)  # then one decode pass: a short request's second token ends it
        runner.decode(seqs)
        for seq in seqs:
            seq.num_computed += 1
            seq.output_ids.append(9)
            if seq.num_output >= seq.params.max_tokens:
                sched.finish(seq, "length")
                if seq is short:
                    steps[seq.rid], short = step + 1 - arrived[seq.rid], None
        ops += (more := sched.take_ops())
        runner.execute(more)
        copied.append(sum(2 * op.ntokens if isinstance(op, SwapRows) else op.ntokens
                          for op in ops if isinstance(op, (CopyRow, SwapRows))))
        resizes += [op for op in ops if isinstance(op, Resize)]
        check_rows(sched, runner, 16)
        sched.check_integrity()
        if long.status is not Status.PREFILLING:
            break
    return copied, steps, sched, resizes


def test_short_requests_passing_a_long_prefill_do_not_move_its_row():
    """Issue 30: each short request that passed a long prompt being prefilled copied the long prompt's row
    three times (a swap when it finished its prefill, a move back when it finished): 0.4-1.3 s a copy for a
    6k-token row of the default model on the 2-core CPU, so the short request's latency grew with the long
    prompt's position (the isolation canary's p99 7.6 s). Now the long row stays where it is, and the
    short ones copy only their own rows, across the gap it leaves. Each short request still takes two
    steps (its prefill beside the long chunk, then its second token), and the rows' contents stay right."""
    copied, steps, sched, _ = passing_a_long_prefill()
    assert len(steps) >= 20 and max(steps.values()) <= 2
    # a short prompt's own row (its 3 prompt tokens and the first output), until the long prompt itself is done
    # and joins the running rows across the gap (one copy of its row)
    assert max(copied[2:-1]) <= 3 + 1 and copied[-1] <= 6000 + 3
    old, old_steps, _, _ = passing_a_long_prefill(move_limit=1 << 62)  # the layout before the gap
    assert old_steps == steps
    assert max(old[len(old) // 2:]) > 3000  # late in the prefill, a short request moved thousands of positions


def test_a_long_prompt_chunked_grows_the_capacity_once():
    """Issue 30: a 6k-token prompt prefilled 128 tokens a pass grew the live buffer's capacity by a quarter at
    a time, 13 copies of the whole buffer, the late ones 1.3-2.9 s each inside a step of the loaded CPU (the
    canary's outliers beside it). Now the capacity grows at once to the prompt's end, and the short requests
    passing it cost no capacity growth. On the block store a Resize reallocates the per-row state only and
    the capacity is bounded by max_len, not the budget (memory is blocks): at once even where 4 rows of the
    whole prompt would not have fit the dense rows."""
    _, steps, _, resizes = passing_a_long_prefill()
    assert max(steps.values()) <= 2
    assert [op.capacity for op in resizes if op.capacity > 128] == [6016]  # 6,000 + its first token, in 128s
    budget = KVBudget(budget_tokens=4 * 3000, max_rows=16, max_len=8000)
    assert budget.shape_for(1, 200, (4, 128), cap_demand=6001) == (4, 6016)
    assert budget.shape_for(1, 200, (4, 128), cap_demand=9000) == (4, 8000)  # bounded by max_len


def test_budget_shape_policy():
    """The per-row state's shape: grown in quanta, bounded by rows and length only (memory is blocks)."""
    b = KVBudget(budget_tokens=1000, max_rows=8, max_len=500, row_quantum=4, cap_quantum=16)
    assert b.shape_for(3, 40, (0, 0)) == (4, 48)
    assert b.shape_for(4, 48, (4, 48)) == (4, 48)  # enough: no change
    assert b.shape_for(5, 48, (4, 48)) == (8, 48)  # rows grown by a quantum
    assert b.shape_for(4, 49, (4, 48)) == (4, 64)  # capacity grown by at least a quarter
    assert b.shape_for(8, 100, (8, 64)) == (8, 112)  # grown to a capacity quantum
    assert b.shape_for(6, 30, (8, 125)) == (8, 125)
    assert b.shape_for(9, 10, (8, 64)) is None  # rows over the limit
    assert b.shape_for(2, 501, (0, 0)) is None


def test_the_front_prefilling_row_leaving_beside_a_long_one_keeps_the_long_one():
    """The row gap's other case: a prefilling row leaving from the front of the region beside a long
    prefilling row moves the region's start (a gap) instead of the long row. It used to drop the long row
    from the region as well (it was popped a second time), so it was neither prefilled nor released."""
    sched = Scheduler(budget=KVBudget(budget_tokens=4000, max_rows=8, max_len=2000), max_prefill_tokens=16,
                      blocks=BlockManager(250, 16), block_size=16)
    short = Sequence(seq_id=1, rid="short", index=0, prompt_ids=[3, 4, 5], params=SamplingParams(max_tokens=2), seed=0)
    long = Sequence(seq_id=2, rid="long", index=0, prompt_ids=list(range(1, 1001)), params=SamplingParams(max_tokens=2),
                    seed=0)
    sched.add([short])
    sched.add([long])
    plan = sched.schedule()
    assert plan.prefill is not None and sched.prefilling == [short, long] and plan.prefill.lengths[1] > 0
    long.num_computed = plan.prefill.lengths[1]  # its first chunk computed (a pass ran), short's not yet
    sched.move_limit = 0  # any computed position makes a row long
    sched.finish(short, "abort")
    assert sched.prefilling == [long] and long.row == 1 and sched.gap == 1
    sched.check_integrity()


@pytest.mark.parametrize("bs", [16, 32])  # the GPUs' block size and the CPU's
def test_memory_follows_tokens_held(bs):
    """One 8k-token sequence and fifteen 100-token ones hold blocks for their own tokens, not 16 rows
    of the longest: at most 1.2x the sum of their lengths (the dense rows held 16 x 8k)."""
    budget = KVBudget(budget_tokens=20_000, max_rows=16, max_len=9000)
    sched = Scheduler(budget=budget, max_prefill_tokens=8192, blocks=None, block_size=bs)
    runner = FakeRunner(sched.blocks, bs)
    lengths = [8192] + [100] * 15
    for i, n in enumerate(lengths):
        sched.add([Sequence(seq_id=i, rid=str(i), index=0, prompt_ids=[1 + i] * n,
                            params=SamplingParams(max_tokens=8), seed=0)])
    while sched.prefilling or sched.waiting:
        plan = sched.schedule()
        runner.execute(plan.ops)
        runner.prefill(plan.prefill)
        runner.execute(sched.complete_prefill(plan.prefill))
    assert len(sched.running) == 16
    held = sched.blocks.num_used * bs
    assert held <= 1.2 * sum(lengths), (held, sum(lengths))
    check_rows(sched, runner, bs)
    sched.check_integrity()


def test_n_forks_share_full_blocks_and_copy_only_the_last():
    bs = 4
    sched = Scheduler(budget=KVBudget(budget_tokens=400, max_rows=8, max_len=200), max_prefill_tokens=64,
                      blocks=BlockManager(100, bs), block_size=bs)
    runner = FakeRunner(sched.blocks, bs)
    group = [Sequence(seq_id=i, rid="g", index=i, prompt_ids=list(range(10)), params=SamplingParams(max_tokens=4),
                      seed=0) for i in range(3)]
    sched.add(group)
    plan = sched.schedule()
    runner.execute(plan.ops)
    runner.prefill(plan.prefill)
    runner.execute(sched.complete_prefill(plan.prefill))
    lead, *followers = group
    assert all(f.status is Status.RUNNING for f in group)
    for f in followers:
        assert f.block_ids[:2] == lead.block_ids[:2]  # the two full blocks: shared
        assert f.block_ids[2] != lead.block_ids[2]  # the partly filled third: copied
    assert runner.copied_blocks == 2
    check_rows(sched, runner, bs)
    sched.check_integrity()

