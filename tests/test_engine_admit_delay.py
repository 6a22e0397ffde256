"""Admissions that wait for a fuller prefill pass (engine.admit_delay_factor, Scheduler.admission_waits): while
rows decode, a prompt that arrives alone waits up to the factor x the last prefill step's time for others to
share its pass; a full pass, an idle engine and a prompt already being prefilled never wait."""

import numpy as np
import pytest

from parallm.engine.scheduler import KVBudget, Scheduler
from parallm.engine.sequence import Sequence
from parallm.protocol import SamplingParams
from tests._engine_helpers import make_engine, run_all, tiny_model
from tests.test_engine_buckets import _workload
from tests.test_engine_scheduler import simulate

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduler(factor: float, clock: Clock, max_prefill_rows: int = 4, prefill_tokens: int = 64) -> Scheduler:
    budget = KVBudget(budget_tokens=4096, max_rows=16, max_len=256, row_quantum=2, cap_quantum=8)
    return Scheduler(budget=budget, max_prefill_tokens=prefill_tokens, blocks=None, block_size=BS,
                     max_prefill_rows=max_prefill_rows, headroom=4, clock=clock, prefix_cache=False,
                     admit_delay_factor=factor)


_ids = iter(range(1, 10_000))


def arrive(sched: Scheduler, n: int, length: int = 8) -> list[Sequence]:
    seqs = []
    for _ in range(n):
        i = next(_ids)
        seq = Sequence(seq_id=i, rid=f"r{i}", index=0, prompt_ids=list(range(1, length + 1)),
                       params=SamplingParams(max_tokens=100), seed=0)
        sched.add([seq])
        seqs.append(seq)
    return seqs


def run_prefill(sched: Scheduler, plan) -> None:
    """What the engine does with a plan's prefill pass: the prompts end in it and their rows decode."""
    work = plan.prefill
    sched.complete_prefill(work)
    for seq in work.seqs:
        seq.output_ids.append(1)
    sched.take_ops()
    for seq in sched.running:
        assert seq.num_computed == seq.num_tokens - 1


def decoding(factor: float, prefill_step_s: float = 0.05) -> tuple[Scheduler, Clock]:
    """A scheduler with rows decoding whose last prefill step took `prefill_step_s`."""
    clock = Clock()
    sched = scheduler(factor, clock)
    arrive(sched, 2)
    plan = sched.schedule()  # an idle engine admits at once, whatever the factor
    assert len(plan.admitted) == 2
    run_prefill(sched, plan)
    clock.t += prefill_step_s
    assert sched.schedule().prefill is None  # the decode step after it times the prefill step
    assert sched.prefill_step_s == pytest.approx(prefill_step_s)
    return sched, clock


def test_a_lone_arrival_waits_for_a_fuller_pass_then_goes_in_it_with_the_others():
    sched, clock = decoding(factor=1.0, prefill_step_s=0.05)
    arrive(sched, 1)
    clock.t += 0.01
    plan = sched.schedule()
    assert plan.admitted == [] and plan.prefill is None and sched.delayed_steps == 1  # rows decode meanwhile
    arrive(sched, 2)
    clock.t += 0.02
    assert sched.schedule().admitted == []  # 0.03 s < 1.0 x 0.05 s since the oldest arrived
    clock.t += 0.025
    plan = sched.schedule()  # 0.055 s: its wait is over; the three share one pass
    assert len(plan.admitted) == 3 and len(plan.prefill.seqs) == 3


def test_a_full_pass_of_prompts_is_admitted_at_once():
    sched, clock = decoding(factor=1.0)
    arrive(sched, 4)  # max_prefill_rows
    assert len(sched.schedule().admitted) == 4


def test_a_pass_full_of_tokens_is_admitted_at_once():
    sched, clock = decoding(factor=1.0)
    arrive(sched, 1, length=70)  # over the 64-token budget
    assert len(sched.schedule().admitted) == 1


def test_without_the_factor_every_arrival_is_admitted_at_the_next_step():
    sched, clock = decoding(factor=0.0)
    arrive(sched, 1)
    assert len(sched.schedule().admitted) == 1 and sched.delayed_steps == 0


def test_an_engine_whose_rows_all_finished_admits_at_once():
    sched, clock = decoding(factor=1.0)
    for seq in list(sched.running):
        sched.finish(seq, "length")
    sched.take_ops()
    arrive(sched, 1)
    assert len(sched.schedule().admitted) == 1


def test_random_workloads_with_the_delay_keep_every_row_right_and_finish():
    """The scheduler's random workloads (rows, prefix blocks, preemption, n > 1, aborts) with admissions that
    wait: the same content and block checks, every request finishes, and steps did wait."""
    delayed = 0
    for seed in range(6):
        delayed += simulate(seed, budget_tokens=4000, prefill_budget=120, admit_delay_factor=3.0)[0].delayed_steps
        delayed += simulate(seed, budget_tokens=120, pool_blocks=8, admit_delay_factor=3.0)[0].delayed_steps
    assert delayed > 20


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_an_engine_whose_admissions_wait_gives_the_same_tokens_in_fewer_passes(mixed):
    """Staggered arrivals into a decoding engine (tests/test_engine_buckets.py's workload): with a large
    factor the prompts that arrive one by one share passes, and every request's greedy tokens and logprobs
    are those of the engine that admits each at once."""
    model = tiny_model("llama")
    runs = {}
    for factor in (0.0, 50.0):
        engine = make_engine(model, admit_delay_factor=factor, mixed_passes=mixed, block_size=8,
                             max_prefill_tokens=64, max_prefill_rows=4)
        passes = []
        record = engine.trace.prefill
        engine.trace.prefill = lambda rows, *a, **k: (passes.append(rows), record(rows, *a, **k))
        runs[factor] = run_all(engine, arrivals=_workload(engine.vocab_size)), passes, engine.scheduler.delayed_steps
    (want, plain, _), (got, fewer, delayed) = runs[0.0], runs[50.0]
    assert set(got) == set(want) and len(got) == 10
    for key in want:
        assert got[key]["tokens"] == want[key]["tokens"], key
        np.testing.assert_allclose(got[key]["logprobs"], want[key]["logprobs"], rtol=1e-5, atol=1e-5)
    assert delayed > 0 and len(fewer) < len(plain), (plain, fewer)
