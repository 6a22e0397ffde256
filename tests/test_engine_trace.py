"""The engine's step records (parallm/engine/trace.py): a burst's passes, phases, row operations,
preemptions and slowest steps, as stats() reports them."""

from __future__ import annotations

import pytest

from parallm.engine import trace
from parallm.protocol import SamplingParams
from tests._engine_helpers import make_engine, req, run_all, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _requests(n: int, length: int = 30, max_tokens: int = 24):
    return [req(f"r{i}", [(7 * i + j) % 97 + 1 for j in range(length)],
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


def test_a_burst_reports_its_passes_ops_and_preemptions(model, monkeypatch):
    monkeypatch.setattr(trace, "BURST_GAP_S", 0.0)
    bpt = 512  # KV bytes per token of the tiny llama (float32, 2 layers x 2 heads x 16 dims, K and V)
    engine = make_engine(model, kv_budget_bytes=bpt * 200, prefix_pool_fraction=0.25, max_prefill_tokens=64)
    run_all(engine, _requests(6))
    s = engine.stats()
    burst = s.last_burst
    assert s.burst is None and burst is not None and burst.done
    assert s.preemptions > 0 and burst.preempted == s.preemptions
    assert s.recomputed_tokens > 0
    assert burst.steps == s.steps == sum(burst.passes.values())
    assert burst.admitted == 6 + s.preemptions
    assert burst.ops.get("Resize", 0) > 0 and burst.ops.get("InitRow", 0) >= 6
    assert burst.prefill_passes > 0 and 0 < burst.prefill_tokens_per_pass <= burst.prefill_padded_per_pass <= 64
    assert burst.new_shapes >= 2 and burst.max_decode_rows >= 1
    slow = burst.slowest
    assert 0 < len(slow) <= trace.SLOWEST_KEPT
    assert [r.ms for r in slow] == sorted((r.ms for r in slow), reverse=True)
    assert slow[0].ms == burst.step_ms_max >= burst.step_ms_p99 >= burst.step_ms_p50 > 0
    assert all(r.kind in ("decode", "prefill", "prefill+decode", "mixed", "read") and r.phase_ms for r in slow)


def test_bursts_are_split_by_an_idle_gap(model, monkeypatch):
    engine = make_engine(model)
    monkeypatch.setattr(trace, "BURST_GAP_S", 3600.0)
    run_all(engine, _requests(2, max_tokens=4))
    first_steps = engine.stats().steps
    run_all(engine, [req("x", [1, 2, 3], SamplingParams(max_tokens=3))])
    s = engine.stats()
    assert s.last_burst is None and s.burst.steps == s.steps  # within the gap: one burst
    monkeypatch.setattr(trace, "BURST_GAP_S", 0.0)
    s = engine.stats()
    assert s.burst is None and s.last_burst.steps == s.steps and s.last_burst.first_step == 1
    run_all(engine, [req("y", [4, 5, 6], SamplingParams(max_tokens=3))])
    s = engine.stats()
    assert s.last_burst.first_step > first_steps and s.last_burst.steps == s.steps - s.last_burst.first_step + 1


def test_step_time_percentiles_come_from_a_bounded_histogram():
    from parallm.protocol import StepRecord

    burst = trace.Burst(1)
    for i in range(20_000):
        burst.add(StepRecord(step=i + 1, ms=float(i % 1000 + 1), kind="decode"))
    r = burst.report(done=True)
    assert r.steps == 20_000 and r.step_ms_max == 1000.0
    assert 500 <= r.step_ms_p50 <= 550 and 990 <= r.step_ms_p99 <= 1000
    assert len(burst.step_hist) < 100 and len(r.slowest) == trace.SLOWEST_KEPT
    assert all(s.ms == 1000.0 for s in r.slowest)


def test_prefill_passes_are_told_apart_by_whether_their_shape_is_new(model, monkeypatch):
    """(rows, L, span) of each prefill pass: the same prompt length twice is one new shape then a
    known one, and the two tallies hold every prefill pass with its phase time."""
    monkeypatch.setattr(trace, "BURST_GAP_S", 0.0)
    engine = make_engine(model, prefix_cache=False, mixed_passes=False)
    run_all(engine, _requests(1, length=12, max_tokens=2))
    run_all(engine, [req("again", [(5 * j) % 97 + 1 for j in range(12)],
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))])
    burst = engine.stats().last_burst
    assert (burst.new_prefill_shapes, burst.known_prefill_passes) == (0, 1)
    assert burst.known_prefill_ms > 0
    assert any(r.prefill_rows and r.prefill_span == 12 and not r.new_prefill_shape for r in burst.slowest)
    run_all(engine, _requests(2, length=9, max_tokens=2))
    burst = engine.stats().last_burst
    assert burst.new_prefill_shapes == 1 and burst.new_prefill_ms > 0
    assert burst.new_prefill_shapes + burst.known_prefill_passes == burst.prefill_passes
