"""Compiled decode (`engine.compiled_decode`, parallm/engine/compiled.py): the tokens and logprobs of
the eager engine, with rows padded to buckets, staggered arrivals, n > 1, preemption, adapters
(their arrays inputs of the trace: a new version needs no retrace), full-weight updates (no
retrace) and a bounded number of traces."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import parallm.engine.compiled as compiled
from _engine_helpers import TINY_VOCAB, greedy, make_engine, run_all, tiny_model, req
from parallm.adapters import save_bytes
from parallm.engine.compiled import row_bucket, span_bucket
from parallm.protocol import SamplingParams
from tests._adapter_helpers import adapter_tensors, lora_model

# Measured on this CPU: every token and logprob below was bit-identical to the eager engine's; the
# math differs only in shapes (padded rows, keys masked up to a power-of-two span), so other BLAS
# builds may round differently: the tolerance allows float32 rounding.
ATOL = 1e-5
# The eager engine's float32 decode passes read the block store with gather_mm over K tiles (the CPU's
# paged read, paged_attention.py) while the compiled pass attends over the gathered K/V: the default
# model's 30 layers round those two differently by up to 1.3e-5 in a logprob (the tokens are the same).
ATOL_ACROSS_READS = 5e-5


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def workload(adapter: str = ""):
    """Rows decoding while others arrive (3 rows -> a padded pass of 4), n = 2, seeded sampling,
    logprobs with alternatives, penalties."""
    first = [req("a", prompt(6, 1), greedy(14, logprobs=True, top_logprobs=3)),
             req("b", prompt(9, 2), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, seed=5,
                                                   ignore_eos=True, logprobs=True), adapter=adapter),
             req("c", prompt(4, 3), greedy(3, logprobs=True))]
    arrivals = {2: [req("d", prompt(3, 4), greedy(8, logprobs=True)),
                    req("h", prompt(5, 8), SamplingParams(temperature=0.7, max_tokens=7, seed=3, ignore_eos=True,
                                                          logprobs=True), n=2)],
                5: [req("g", prompt(21, 7), greedy(6, presence_penalty=0.7, repetition_penalty=1.3, logprobs=True))]}
    return first, arrivals


def assert_same(got: dict, want: dict, atol: float = ATOL) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert g["tokens"] == w["tokens"], key
        assert g["finish"] == w["finish"] and g["usage"] == w["usage"], key
        np.testing.assert_allclose(g["logprobs"], w["logprobs"], rtol=0, atol=atol)
        assert [[t for t, _ in top] for top in g["top"]] == [[t for t, _ in top] for top in w["top"]], key


def both(model, setup=None, workload_args=(), **engine) -> tuple[dict, dict, object]:
    """The workload on an eager and a compiled engine; returns (eager, compiled, compiled engine's stats)."""
    out = {}
    for on in (False, True):
        e = make_engine(model, compiled_decode=on, **engine)
        if setup is not None:
            setup(e)
        first, arrivals = workload(*workload_args)
        out[on] = run_all(e, first, arrivals=arrivals)
        stats = e.stats()
    return out[False], out[True], stats


def test_buckets():
    assert [row_bucket(n, 64) for n in (1, 2, 3, 5, 17, 33, 64)] == [1, 2, 4, 8, 32, 64, 64]
    assert row_bucket(3, 3) == 3 and row_bucket(70, 256) == 96
    assert [span_bucket(s, 4096) for s in (1, 128, 129, 700)] == [128, 128, 256, 1024] and span_bucket(700, 640) == 640


# other families are slow-marked: on a fresh machine each compiles its own fused kernels (~1-2 s each)
SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,mixed", [("llama", False), pytest.param("llama", True, marks=SLOW),
                                        pytest.param("llama-sliding", False, marks=SLOW),
                                        pytest.param("llama3-rope", False, marks=SLOW),
                                        pytest.param("qwen3", False, marks=SLOW)])
def test_compiled_decode_gives_the_eager_tokens_and_logprobs(name, mixed):
    eager, comp, stats = both(tiny_model(name), mixed_passes=mixed, max_prefill_tokens=24)
    assert_same(comp, eager)
    counts = stats.compiled_decode
    assert counts["compiled"] >= 10 and counts["padded"] >= 1 and counts["traces"] <= 8, counts
    assert not any(k.startswith("eager_") for k in counts), counts


def test_preemption_under_a_tight_budget():
    """96 live token slots for four sequences that grow to 27-54 tokens: one is preempted and recomputed."""
    model = tiny_model("llama")
    bpt = make_engine(model).runner.live.bytes_per_token
    out, counts = {}, {}
    for on in (False, True):
        e = make_engine(model, compiled_decode=on, mixed_passes=False, max_prefill_tokens=16, block_size=4,
                        kv_budget_bytes=bpt * 128, prefix_pool_fraction=0.25, max_num_seqs=8)
        out[on] = run_all(e, [req(f"t{i}", prompt(n, i), greedy(24, logprobs=True))
                              for i, n in enumerate((3, 10, 20, 30))])
        assert e.stats().preemptions > 0
        counts[on] = e.stats().compiled_decode
    assert counts[True]["compiled"] >= 10, counts
    assert_same(out[True], out[False])


@pytest.mark.parametrize("dora,merge_mb", [(False, 0), (True, 0), (False, 64)], ids=["lora", "dora", "merged"])
def test_adapter_rows_run_compiled_and_match(dora, merge_mb):
    """One adapter beside base rows (a mixed plan: per-row slots into stacks), the adapter alone (a
    single plan), factored, DoRA or merged into a copy of the weights."""
    model, ref = tiny_model("llama"), tiny_model("llama")
    config = lora_model(ref, rank=4, dora=dora)
    blob = save_bytes(adapter_tensors(ref))
    eager, comp, stats = both(model, setup=lambda e: e.load_adapter("pol", config=config, weights=blob),
                              workload_args=("pol",), mixed_passes=False, max_prefill_tokens=24,
                              adapter_merge_mb=merge_mb)
    assert_same(comp, eager)
    counts = stats.compiled_decode
    assert counts["adapter"] >= 3 and counts["compiled"] >= 10, counts
    assert not any(k.startswith("eager_") for k in counts), counts


def test_new_adapter_version_needs_no_retrace():
    model = tiny_model("llama")
    versions = []
    for seed in (1, 2):
        ref = tiny_model("llama")
        config = lora_model(ref, rank=4, seed=seed)
        versions.append((config, save_bytes(adapter_tensors(ref))))
    out, traces = {}, []
    for on in (False, True):
        e = make_engine(model, compiled_decode=on, mixed_passes=False)
        for v, (config, blob) in enumerate(versions):
            e.load_adapter("pol", config=config, weights=blob)
            out[on, v] = run_all(e, [req(f"v{v}", prompt(7, 9), greedy(8, logprobs=True), adapter="pol")])
            if on:
                traces.append(e.stats().compiled_decode["traces"])
    assert out[False, 0][("v0", 0)]["tokens"] != out[False, 1][("v1", 0)]["tokens"]
    for v in (0, 1):
        assert_same(out[True, v], out[False, v])
    counts = e.stats().compiled_decode
    assert counts["adapter"] >= 12 and not any(k.startswith("eager_") for k in counts), counts
    assert traces[1] == traces[0] >= 1


def test_weight_update_needs_no_retrace():
    old, new = tiny_model("llama", 0), tiny_model("llama", 1)
    weights = dict(tree_flatten(new.parameters()))
    want = run_all(make_engine(new, mixed_passes=False), [req("a", prompt(7, 9), greedy(8, logprobs=True))])
    e = make_engine(old, compiled_decode=True, mixed_passes=False)
    before = run_all(e, [req("a", prompt(7, 9), greedy(8, logprobs=True))])
    traces = e.stats().compiled_decode["traces"]
    e.update_weights(tensors=weights)
    after = run_all(e, [req("b", prompt(7, 9), greedy(8, logprobs=True))])
    assert before[("a", 0)]["tokens"] != want[("a", 0)]["tokens"]
    assert after[("b", 0)]["tokens"] == want[("a", 0)]["tokens"]
    np.testing.assert_allclose(after[("b", 0)]["logprobs"], want[("a", 0)]["logprobs"], rtol=0, atol=ATOL)
    assert e.stats().compiled_decode["traces"] == traces


def test_traces_are_bounded(monkeypatch):
    monkeypatch.setattr(compiled, "MAX_TRACES", 2)
    eager, comp, stats = both(tiny_model("llama"), mixed_passes=False, max_prefill_tokens=24)
    assert_same(comp, eager)
    assert stats.compiled_decode["evicted"] >= 1 and stats.compiled_decode["traces"] >= 3


@SLOW
def test_expert_adapters_run_eagerly():
    """A MoE model: base rows compile; a pass with a row under an adapter on expert projections runs eagerly."""
    from mlx_lm.models.switch_layers import SwitchLinear

    from _engine_helpers import reference_greedy
    from parallm.models import tiny

    base, _ = tiny.build_any("qwen3_moe")
    lora, _ = tiny.build_any("qwen3_moe")
    keys = sorted({p for layer in lora.layers for p, m in layer.named_modules() if isinstance(m, SwitchLinear)})
    config = lora_model(lora, keys=tuple(keys), seed=1, rank=4)
    ids = [(7 * j + 3) % tiny.V for j in range(9)]
    e = make_engine(base, compiled_decode=True, mixed_passes=False)
    e.load_adapter("experts", config=config, weights=save_bytes(adapter_tensors(lora)))
    out = {**run_all(e, [req("base", ids, greedy(6))]), **run_all(e, [req("lora", ids, greedy(6), adapter="experts")])}
    assert out[("base", 0)]["tokens"] == reference_greedy(base, ids, 6)
    assert out[("lora", 0)]["tokens"] == reference_greedy(lora, ids, 6)
    counts = e.stats().compiled_decode
    assert counts["eager_adapter"] >= 5 and counts["compiled"] >= 1, counts


@SLOW
def test_default_model_rows_arriving_over_time():
    """The embedded default model (SmolLM2-135M, float32): 8 rows arriving over four steps, n = 2."""
    from _default_model import default_model

    model = default_model()
    rng = random.Random(3)
    ids = [[rng.randrange(1000, 40000) for _ in range(5 + 3 * i)] for i in range(8)]
    out = {}
    for on in (False, True):
        e = make_engine(model, compiled_decode=on, max_model_len=1024)
        reqs = [req(f"r{i}", p, greedy(12, logprobs=True), n=2 if i == 3 else 1) for i, p in enumerate(ids)]
        out[on] = run_all(e, reqs[:2], arrivals={1: reqs[2:4], 2: reqs[4:6], 3: reqs[6:]})
        if on:
            assert e.stats().compiled_decode["compiled"] >= 5
    assert_same(out[True], out[False], ATOL_ACROSS_READS)


def test_a_pass_that_does_not_trace_runs_eagerly_from_then_on():
    model = tiny_model("llama")
    e = make_engine(model, compiled_decode=True, mixed_passes=False)
    compiled_pass = e.runner.compiled
    traced_model = compiled_pass.call_model

    def reads_a_value(tokens, cache):  # a model that reads an array's value mid-pass cannot be traced
        if int(tokens[0, 0].item()) < 0:
            raise AssertionError("unreachable")
        return traced_model(tokens, cache)

    compiled_pass.call_model = reads_a_value
    got = run_all(e, [req("a", prompt(6, 1), greedy(8, logprobs=True))])
    want = run_all(make_engine(model, mixed_passes=False), [req("a", prompt(6, 1), greedy(8, logprobs=True))])
    assert_same(got, want)
    counts = e.stats().compiled_decode
    assert counts["eager_trace_failed"] >= 7 and "compiled" not in counts, counts


def test_a_compiled_pass_waits_for_the_pass_in_flight_where_decode_writes_in_place(monkeypatch):
    """The trace stores K/V with an MLX scatter, so with CUDA's in-place writes on (where eager decode passes
    never wait) a compiled pass still makes settle() wait for the pass in flight: else MLX would copy the whole
    store for the write. The flag is set by hand here (in-place writes run on CUDA only)."""
    e = make_engine(tiny_model("llama"), compiled_decode=True)
    live = e.runner.live
    e.add_request(req("a", prompt(6, 1), greedy(8)))
    while e.stats().waiting or e.stats().prefilling:
        e.step()
    live.writes_in_place, live.settle_bytes = True, 0
    waits = []
    real = mx.synchronize
    monkeypatch.setattr(mx, "synchronize", lambda *a: (waits.append(1), real(*a))[1])
    before = e.stats().compiled_decode.get("compiled", 0)
    for _ in range(3):
        e.step()
    compiled_steps = e.stats().compiled_decode["compiled"] - before
    assert compiled_steps == 3 and len(waits) >= compiled_steps
