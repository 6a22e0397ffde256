"""Device memory: a resize that runs out of memory is retried with MLX's buffer cache freed (the
H100 c=256 engine failure of issue 24 was cudaMallocAsync failing in LiveKV.resize), and
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


def test_a_resize_that_runs_out_of_memory_keeps_the_content(monkeypatch):
    live = LiveKV([LayerShape(k_heads=2, k_dim=4, v_heads=2, v_dim=4)], mx.float32)
    live.resize(2, 8)
    live.keys[0][:, :, :8] = mx.arange(2 * 2 * 8 * 4, dtype=mx.float32).reshape(2, 2, 8, 4)
    before = live.keys[0]
    mx.eval(before)
    monkeypatch.setattr(mx, "eval", FailingEvals(1))
    live.resize(4, 16)
    assert (live.rows, live.capacity) == (4, 16)
    assert mx.array_equal(live.keys[0][:2, :, :8], before).item()
    assert not mx.any(live.keys[0][2:]).item()


def test_an_engine_whose_resize_runs_out_of_memory_once_serves_every_request(engines, monkeypatch):
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
