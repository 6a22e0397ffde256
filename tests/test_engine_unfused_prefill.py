"""engine.unfused_prefill_keys: prefill passes over short spans attend with plain matmuls and a
softmax (fastmath.unfused_sdpa) instead of MLX's fused kernel; the tokens and logprobs are the
stock kernel's."""

import mlx.core as mx
import numpy as np
import pytest

from parallm.engine import fastmath

from _engine_helpers import greedy, make_engine, reference_greedy, req, run_all, tiny_model

PROMPTS = [[(7 * i + 3 * j) % 97 + 2 for j in range(n)] for i, n in enumerate((5, 17, 9, 30, 3))]


def _run(model, limit: int, calls: list[int]) -> dict:
    engine = make_engine(model, fast_math=False, unfused_prefill_keys=limit, max_prefill_tokens=24, block_size=4)
    reqs = [req(f"r{i}", p, greedy(8, logprobs=True)) for i, p in enumerate(PROMPTS)]
    reqs.append(req("again", PROMPTS[3][:24] + [5, 6], greedy(8, logprobs=True)))  # a prefix hit: the span starts past 0
    out = run_all(engine, reqs[:2], arrivals={1: reqs[2:4], 4: reqs[4:]})
    assert engine.stats().kv_blocks_used == 0
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_short_prefills_attend_unfused_with_the_stock_tokens(monkeypatch, dtype):
    model = tiny_model("llama3-rope")
    model.set_dtype(dtype)
    calls: list[int] = []
    real = fastmath.unfused_sdpa
    monkeypatch.setattr(fastmath, "unfused_sdpa", lambda q, *a: (calls.append(q.shape[2]), real(q, *a))[1])
    unfused = _run(model, 4096, calls)
    assert calls and all(n > 1 for n in calls)  # prefill passes only, never a decode step
    n_unfused = len(calls)
    stock = _run(model, 0, calls)
    assert len(calls) == n_unfused  # 0: the fused kernel only
    for i, p in enumerate(PROMPTS):
        assert unfused[(f"r{i}", 0)]["tokens"] == reference_greedy(model, p, 8), i
    for key, want in stock.items():
        assert unfused[key]["tokens"] == want["tokens"], key
        if dtype == mx.float32:
            np.testing.assert_allclose(unfused[key]["logprobs"], want["logprobs"], rtol=1e-4, atol=1e-5)


def test_longer_spans_keep_the_fused_kernel(monkeypatch):
    calls: list[int] = []
    real = fastmath.unfused_sdpa
    monkeypatch.setattr(fastmath, "unfused_sdpa", lambda q, *a: (calls.append(q.shape[2]), real(q, *a))[1])
    _run(tiny_model("llama"), 8, calls)
    assert calls and max(calls) <= 8  # chunks of at most 8 positions; the longer ones went to the fused kernel


@pytest.mark.parametrize("name", ["llama-sliding", "gemma3_text", "qwen3", "phi3"])
def test_other_families_and_sliding_windows_keep_their_tokens(monkeypatch, name):
    calls: list[int] = []
    real = fastmath.unfused_sdpa
    monkeypatch.setattr(fastmath, "unfused_sdpa", lambda q, *a: (calls.append(q.shape[2]), real(q, *a))[1])
    model = tiny_model(name)
    model.set_dtype(mx.bfloat16)
    unfused, stock = _run(model, 4096, calls), _run(model, 0, [])
    assert calls
    assert {k: v["tokens"] for k, v in unfused.items()} == {k: v["tokens"] for k, v in stock.items()}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_masked_decode_attends_unfused_with_the_stock_tokens(monkeypatch, dtype):
    """engine.unfused_decode: decode passes of rows at different lengths (an array mask) attend with
    unfused_sdpa; a lone row's decode (no mask) keeps the stock call; the tokens are the stock ones."""
    model = tiny_model("llama3-rope")
    model.set_dtype(dtype)
    calls: list[tuple[int, bool]] = []
    real = fastmath.unfused_sdpa
    monkeypatch.setattr(fastmath, "unfused_sdpa",
                        lambda q, k, v, scale, mask: (calls.append((q.shape[2], mask is not None)),
                                                      real(q, k, v, scale, mask))[1])

    def run(on: bool) -> dict:
        engine = make_engine(model, fast_math=False, unfused_decode=on, mixed_passes=False, max_prefill_tokens=24)
        reqs = [req(f"r{i}", p, greedy(8, logprobs=True)) for i, p in enumerate(PROMPTS)]
        out = run_all(engine, reqs[:1], arrivals={3: reqs[1:3], 5: reqs[3:]})
        assert engine.stats().kv_blocks_used == 0
        return out

    unfused = run(True)
    assert calls and all(n == 1 and masked for n, masked in calls)  # decode under a mask only
    n_unfused = len(calls)
    stock = run(False)
    assert len(calls) == n_unfused
    for key, want in stock.items():
        assert unfused[key]["tokens"] == want["tokens"], key
        if dtype == mx.float32:
            np.testing.assert_allclose(unfused[key]["logprobs"], want["logprobs"], rtol=1e-4, atol=1e-5)
