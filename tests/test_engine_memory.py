"""Device memory: a growth of the KV block store that runs out of memory is retried with MLX's
buffer cache freed (the H100 c=256 engine failure of issue 24 was cudaMallocAsync failing in the
dense rows' resize, which the store's growth replaced), and
engine.buffer_cache_mb bounds MLX's buffer cache."""

import mlx.core as mx
import pytest

from parallm.engine import make_request
from parallm.engine.cache import LayerShape, LiveKV
from parallm.engine.memory import is_out_of_memory, limit_buffer_cache, retry_out_of_memory

from _engine_helpers import greedy, make_engine, reference_greedy, run_all, tiny_model

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


class FailingEvals:
    """mx.eval that raises CUDA's out-of-memory error on its first `failures` calls with arrays."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.raised = 0
        self.real = mx.eval

    def __call__(self, *args):
        if self.raised < self.failures:
            self.raised += 1
            raise RuntimeError(CUDA_OOM)
        return self.real(*args)


def test_out_of_memory_errors_are_told_apart():
    assert is_out_of_memory(RuntimeError(CUDA_OOM))
    assert is_out_of_memory(RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory "
                                         "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"))
    assert not is_out_of_memory(RuntimeError("[reshape] Cannot reshape array"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_retry_once_then_give_up():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(CUDA_OOM)
        return "ok"

    assert retry_out_of_memory(flaky) == "ok" and len(calls) == 2
    with pytest.raises(RuntimeError, match="out of memory"):
        retry_out_of_memory(lambda: (_ for _ in ()).throw(RuntimeError(CUDA_OOM)))
    with pytest.raises(RuntimeError, match="reshape"):
        retry_out_of_memory(lambda: (_ for _ in ()).throw(RuntimeError("[reshape] bad")))


def test_a_store_growth_that_runs_out_of_memory_keeps_the_content(monkeypatch):
    live = LiveKV([LayerShape(k_heads=2, k_dim=4, v_heads=2, v_dim=4)], mx.float32, block_size=4)
    live.ensure(4)
    n = live.keys[0].shape[1]  # slots of the head-major store [heads, slots, dim]
    live.keys[0][:] = mx.arange(n * 2 * 4, dtype=mx.float32).reshape(2, n, 4)
    before = live.keys[0]
    mx.eval(before)
    monkeypatch.setattr(mx, "eval", FailingEvals(1))
    live.ensure(40)
    assert live.store_blocks >= 40
    assert mx.array_equal(live.keys[0][:, :n], before).item()
    assert not mx.any(live.keys[0][:, n:]).item()


def test_an_engine_whose_store_growth_runs_out_of_memory_once_serves_every_request(engines, monkeypatch):
    model = tiny_model("llama")
    prompts = [[1 + i, 5, 9, 2 + i, 7][: 3 + i % 3] for i in range(6)]
    expected = {f"r{i}": reference_greedy(model, p, 12) for i, p in enumerate(prompts)}
    engine = make_engine(model)
    engines.append(engine)
    failing = FailingEvals(1)
    monkeypatch.setattr(mx, "eval", failing)
    results = run_all(engine, [make_request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)])
    assert failing.raised == 1
    assert {rid: r["tokens"] for (rid, _), r in results.items()} == expected


def test_engine_buffer_cache_mb_bounds_mlx_buffer_cache():
    previous = mx.set_cache_limit(123 << 20)
    try:
        limit_buffer_cache(None)
        assert mx.set_cache_limit(123 << 20) == 123 << 20
        make_engine(tiny_model("llama"), buffer_cache_mb=64)
        assert mx.set_cache_limit(123 << 20) == 64 << 20
    finally:
        mx.set_cache_limit(previous)


@pytest.mark.slow  # ~25 s on the shared 2-core CPU (an 8k-token prefill); the scheduler-level check is
# tests/test_engine_scheduler.py::test_memory_follows_tokens_held
def test_one_long_row_and_fifteen_short_ones_hold_their_own_tokens():
    """Issue 41's memory check on a real engine: one 8k-token row and fifteen 100-token rows hold blocks for
    at most 1.2x the sum of their lengths (the dense rows held 16 rows of the longest), and the store's
    arrays (grown by half at a time) stay within 1.5x of that."""
    from parallm.protocol import SamplingParams

    engine = make_engine(tiny_model("llama"), max_model_len=9000, max_prefill_tokens=2048, block_size=16,
                         mixed_passes=False)
    lengths = [8192] + [100] * 15
    for i, n in enumerate(lengths):
        engine.add_request(make_request(f"r{i}", [(7 * j + i) % 90 + 1 for j in range(n)],
                                        params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)))
    while engine.stats().running < len(lengths):
        engine.step()
    engine.check_integrity()
    held = sum(s.num_computed for s in engine.scheduler.running)
    blocks = engine.blocks.num_used * engine.config.block_size
    assert sum(lengths) <= held and blocks <= 1.2 * held, (blocks, held)
    live = engine.runner.live
    assert live.kv_bytes <= 1.5 * blocks * live.bytes_per_token + 17 * 16 * live.bytes_per_token, \
        (live.kv_bytes, blocks * live.bytes_per_token)
    for i in range(len(lengths)):
        engine.abort(f"r{i}")
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    assert engine.blocks.num_used == 0


def test_a_preallocated_store_holds_the_budget_from_the_start_and_never_grows(engines):
    """engine.kv_preallocate (a CUDA GPU's default): the store is allocated at the budget's blocks when the
    engine starts, so no growth copies it (or waits for the device) while requests run; same tokens."""
    from parallm.config import EngineConfig, resolve_engine_config

    assert resolve_engine_config(EngineConfig(), "cuda").kv_preallocate is True
    assert resolve_engine_config(EngineConfig(), "cpu").kv_preallocate is False
    model = tiny_model("llama")
    engine = make_engine(model, kv_preallocate=True)
    engines.append(engine)
    live = engine.runner.live
    blocks = live.store_blocks
    assert blocks * engine.config.block_size == engine.kv_capacity_tokens
    prompts = [[1 + i, 5, 9, 2 + i, 7][: 3 + i % 3] for i in range(6)]
    results = run_all(engine, [make_request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)])
    assert {rid: r["tokens"] for (rid, _), r in results.items()} == \
        {f"r{i}": reference_greedy(model, p, 12) for i, p in enumerate(prompts)}
    assert live.store_blocks == blocks
