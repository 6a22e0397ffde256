"""The live buffer's rows grow to the queue's demand at once (plan.KVBudget.shape_for, issue 19):
a burst of arrivals costs one or two copies of the buffer, not one per step of admissions."""

from __future__ import annotations

from parallm.engine.plan import KVBudget, Resize
from parallm.protocol import SamplingParams
from tests._engine_helpers import make_engine, req, run_all, tiny_model


def test_rows_grow_to_the_demand_within_the_bounds():
    b = KVBudget(budget_tokens=4096, max_rows=64, max_len=500, row_quantum=4, cap_quantum=16)
    assert b.shape_for(5, 48, (4, 48)) == (8, 48)  # by at least half (4 -> 6, to a quantum)
    assert b.shape_for(5, 48, (4, 48), demand=30) == (32, 48)  # to what the queue wants, at once
    assert b.shape_for(5, 48, (4, 48), demand=100) == (64, 48)  # never past max_rows
    assert b.shape_for(5, 100, (4, 48), demand=64) == (64, 112)  # memory is blocks: rows x length is not bounded
    assert b.shape_for(40, 100, (40, 100), demand=64) == (40, 100)  # enough: no change, whatever the demand
    assert b.shape_for(65, 110, (40, 100), demand=64) is None  # past max_rows


def test_a_burst_grows_the_buffer_in_a_few_resizes():
    engine = make_engine(tiny_model("llama"), max_num_seqs=48, max_prefill_tokens=64)
    resizes: list[Resize] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda ops, *a: (resizes.extend(op for op in ops if isinstance(op, Resize)),
                                             execute(ops, *a))
    reqs = [req(f"r{i}", [(5 * i + j) % 97 + 1 for j in range(20)],
                SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) for i in range(48)]
    run_all(engine, reqs)
    assert [r.rows for r in resizes][:1] == [48]  # the first grow takes every queued row
    assert len(resizes) <= 3, resizes  # was one per step of admissions (4 rows at a time: 12+)


def test_the_auto_kv_budget_on_a_cuda_gpu_is_half_its_free_memory(monkeypatch):
    import mlx.core as mx

    from parallm.engine import memory

    GiB = 1 << 30
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx, "device_info", lambda: {"free_memory": 120 * GiB, "total_memory": 141 * GiB})
    assert memory.auto_kv_budget_bytes(weight_bytes=17 * GiB) == 60 * GiB  # the weights are resident
    assert memory.auto_kv_budget_bytes(weight_bytes=40 * GiB) == int(101 * GiB * memory.CUDA_KV_FRACTION)  # not yet
    monkeypatch.setattr(mx, "device_info", lambda: {"free_memory": 0, "total_memory": 141 * GiB})
    assert memory.auto_kv_budget_bytes() == 64 << 20  # the floor
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert memory.cuda_memory() is None  # MLX's CPU device: the host's memory rule


def test_on_a_cuda_gpu_the_buffer_cache_is_capped_at_what_the_kv_leaves(monkeypatch):
    import mlx.core as mx

    from parallm.engine import memory

    GiB = 1 << 30
    limits = []
    monkeypatch.setattr(memory, "cuda_memory", lambda: (100 * GiB, 141 * GiB))
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: limits.append(n) or 0)
    assert memory.bound_cuda_cache(50 * GiB, weight_bytes=17 * GiB) == int(50 * GiB * memory.CUDA_CACHE_SHARE)
    assert memory.bound_cuda_cache(98 * GiB) is None  # under the floor: MLX's own limit stays
    assert limits == [int(50 * GiB * memory.CUDA_CACHE_SHARE)]
    monkeypatch.setattr(memory, "cuda_memory", lambda: None)
    assert memory.bound_cuda_cache(1 * GiB) is None and len(limits) == 1


def test_the_engine_reports_the_cache_cap_it_set(monkeypatch):
    import mlx.core as mx

    from parallm.engine import memory

    GiB = 1 << 30
    monkeypatch.setattr(memory, "cuda_memory", lambda: (10 * GiB, 141 * GiB))
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: 0)
    engine = make_engine(tiny_model("llama"), kv_budget_bytes=64 << 20)
    assert engine.config.buffer_cache_mb == (10 * GiB - (64 << 20)) * memory.CUDA_CACHE_SHARE // 1 / (1 << 20)
    assert make_engine(tiny_model("llama"), buffer_cache_mb=512).config.buffer_cache_mb == 512  # as configured


def test_a_long_prompt_grows_the_block_store_once_for_its_whole_length():
    """Scheduler.blocks_ahead: the store is grown for an admitted prompt's end at once, not by half again
    each time its chunks reach the store's end (every layer's store copied each time: 0.4-1 s a growth
    beside a 6k-token prompt on the 2-core CPU, issue 30's canary waiting on them)."""
    engine = make_engine(tiny_model("llama"), max_prefill_tokens=8, block_size=4)
    live = engine.runner.live
    sizes: list[int] = []
    ensure = live.ensure
    live.ensure = lambda blocks: (ensure(blocks), sizes.append(live.store_blocks))
    prompt = [(7 * j) % 97 + 1 for j in range(300)]
    run_all(engine, [req("long", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    grown = sorted(set(sizes))
    assert len(grown) == 1 and grown[0] >= 304 // 4, grown  # one size from the first step: the prompt's 76 blocks
