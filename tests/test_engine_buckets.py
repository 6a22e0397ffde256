"""Prefill shape buckets (engine.prefill_buckets): a prefill pass padded to its length's bucket
gives every row the tokens of the unpadded pass and its logprobs to float rounding, and a run's passes take few shapes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from parallm.engine.plan import length_bucket, length_buckets
from parallm.engine.warmup import bucket_shapes
from parallm.models import tiny
from parallm.protocol import SamplingParams
from tests._engine_helpers import make_engine, req, run_all, tiny_model


def test_length_buckets_are_powers_of_two_up_to_the_budget():
    assert length_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert length_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert [length_bucket(n, 512) for n in (1, 16, 17, 159, 511, 512)] == [16, 16, 32, 256, 512, 512]
    assert length_bucket(700, 512) == 700  # never below the chunk (a budget always bounds it)
    shapes = bucket_shapes(512, 16)
    assert (1, 512, 512) in shapes and (3, 170, 256) in shapes and (16, 32, 32) in shapes
    assert all(k * n <= 512 and length_bucket(n, 512) == b for k, n, b in shapes)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request):
    return tiny_model("llama") if request.param == "llama" else tiny.build_any("qwen3_moe")[0]


def _workload(vocab: int):
    """Staggered arrivals of prompts of many lengths; the last two share a 24-token prefix with an
    earlier prompt (a prefix-cache hit once it has finished)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (5, 37, 9, 21, 50, 13, 3, 29)]
    prompts += [prompts[1][:24] + [7, 8, 9], prompts[4][:24] + [1] * 11]
    arrivals: dict[int, list] = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
        arrivals.setdefault([0, 0, 0, 2, 3, 3, 5, 6, 14, 15][i], []).append(req(f"r{i}", p, params))
    return arrivals


def _run(model, buckets: bool, mixed: bool):
    engine = make_engine(model, prefill_buckets=buckets, mixed_passes=mixed, block_size=8, max_prefill_tokens=64)
    shapes = set()
    record = engine.trace.prefill

    def prefill(rows: int, tokens: int, length: int, span: int = 0, capacity: int = 0) -> None:
        shapes.add((rows, length))
        record(rows, tokens, length, span, capacity)

    engine.trace.prefill = prefill
    out = run_all(engine, arrivals=_workload(engine.vocab_size))
    return out, shapes, engine.stats()


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_buckets_change_no_token_or_logprob(model, mixed):
    want, plain_shapes, _ = _run(model, False, mixed)
    got, shapes, stats = _run(model, True, mixed)
    assert stats.prefix_hit_tokens > 0
    assert set(got) == set(want) and len(got) == 10
    for key in want:
        assert got[key]["tokens"] == want[key]["tokens"], key
        # a longer padded pass attends over more (masked) keys: the sums are blocked differently
        np.testing.assert_allclose(got[key]["logprobs"], want[key]["logprobs"], rtol=1e-5, atol=1e-5)
    if not mixed:
        assert {length for _, length in shapes} <= set(length_buckets(64))
        assert len(shapes) < len(plain_shapes)


def test_models_prefilled_alone_are_not_padded():
    engine = make_engine(tiny.build_any("mamba")[0], prefill_buckets=True)
    assert engine.runner.info.prefill_alone and not engine.scheduler.admission.buckets
    lengths = []
    record = engine.trace.prefill
    engine.trace.prefill = lambda rows, tokens, length, span=0, capacity=0: (lengths.append((tokens, length)),
                                                                  record(rows, tokens, length, span, capacity))
    run_all(engine, [req("a", list(range(1, 20)), SamplingParams(temperature=0.0, max_tokens=2))])
    assert lengths == [(19, 19)]


def test_warm_up_runs_every_bucket_shape_and_leaves_nothing_cached():
    engine = make_engine(tiny_model("llama"), prefill_buckets=True, mixed_passes=False, max_prefill_tokens=32,
                         max_prefill_rows=4, block_size=8)
    shapes = set()
    record = engine.trace.prefill
    engine.trace.prefill = lambda rows, tokens, length, span=0, capacity=0: (shapes.add((rows, length)),
                                                                  record(rows, tokens, length, span, capacity))
    engine.warm_up()
    assert {(k, b) for k, _, b in bucket_shapes(32, 4)} <= shapes
    assert engine.blocks.num_cached == 0 and not engine.has_work()
