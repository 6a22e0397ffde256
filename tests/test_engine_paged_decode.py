"""Decode passes read the KV block store through paged attention (cache.PagedMask, engine/paged_decode.py)
where the engine's attention stand-ins run the model's attention: every way gives the tokens the
gathered K/V give, and a model whose own attention takes no paged mask falls back to the gather."""

from __future__ import annotations

import logging

import pytest

from tests._engine_helpers import greedy, make_engine, reference_greedy, req, run_all, tiny_model, wide_heads_model

PROMPTS = [[(i * 7 + k) % 97 + 1 for i in range(9 + 13 * k)] for k in range(4)]


def outputs(engine) -> dict:
    """Greedy tokens of four prompts of different lengths, two arriving later (rows at different lengths)."""
    reqs = [req(f"r{k}", p, greedy(12)) for k, p in enumerate(PROMPTS)]
    out = run_all(engine, reqs[:2], arrivals={3: reqs[2:]}, check_every=True)
    return {k: v["tokens"] for k, v in out.items()}


@pytest.mark.parametrize("way", [None, "gather", "gather_mm"])
def test_every_paged_way_gives_the_gathered_tokens(way):
    model = tiny_model("llama")
    want = outputs(make_engine(model, paged_decode="off", block_size=4))
    engine = make_engine(model, paged_decode=way, block_size=4)
    assert outputs(engine) == want
    assert engine.runner.pages_decode and engine.runner.paged_way == (way or "auto")
    assert want[("r0", 0)] == reference_greedy(model, PROMPTS[0], 12)


def test_off_and_quantized_kv_read_the_gather():
    from parallm.config import KVConfig

    model = tiny_model("llama")
    assert not make_engine(model, paged_decode="off").runner.pages_decode
    assert not make_engine(wide_heads_model(), kv=KVConfig(bits=8, group_size=32)).runner.pages_decode


def test_a_model_with_its_own_attention_reads_the_gather():
    """gemma2's attention splits the GQA heads itself (no stock attention call to stand in for)."""
    model = tiny_model("gemma2")
    engine = make_engine(model)
    assert engine.runner.paged_way is None and not engine.runner.pages_decode
    assert outputs(engine)[("r1", 0)] == reference_greedy(model, PROMPTS[1], 12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fault", ["none", "drop_newest_key", "scale_1.25"])
def test_the_check_turns_off_a_read_that_is_wrong_not_one_that_rounds(monkeypatch, dtype, fault):
    """check_paged_decode judges the logits' difference against the largest logit: a paged read that
    misses the newest key or scales the scores (32 % / 10 % of the largest logit on this model) is turned
    off, in float32 and bfloat16 alike; the read itself is kept."""
    import mlx.core as mx

    from parallm.engine import cache as cache_module
    from parallm.engine.paged_attention import PagedRead

    real = cache_module.paged_decode_attention

    def read(queries, k4, v4, paged, scale, way, **kw):
        if fault == "drop_newest_key":
            paged = PagedRead(paged.tables, paged.lengths - 1)
        elif fault == "scale_1.25":
            scale *= 1.25
        return real(queries, k4, v4, paged, scale, way, **kw)

    monkeypatch.setattr(cache_module, "paged_decode_attention", read)
    model = tiny_model("llama")
    model.set_dtype(getattr(mx, dtype))
    assert make_engine(model, paged_decode="gather").runner.pages_decode == (fault == "none")


def buffer_addresses(arrays) -> list[int]:
    """Where each (evaluated) array's data lives: a write that copies the array moves it."""
    import numpy as np

    out = []
    for a in arrays:
        view = np.asarray(memoryview(a))
        out.append(view.ctypes.data)
        del view  # a view left alive would itself keep the next write from happening in place
    return out


@pytest.mark.parametrize("paged", ["auto", "off"])
def test_decode_steps_write_the_block_store_in_place(paged):
    """A pass scatters its new K/V into each layer's store; MLX writes in place only when nothing else
    holds the store (a view, a gather, a graph not yet evaluated), otherwise it copies the whole store
    first. Over decode steps of rows at different lengths the stores' buffers never move: no step
    copies them (the store is allocated at the budget, so growth does not move it either)."""
    # in_place_kv_mb 0: every pass that writes with MLX ops waits for the one in flight (on a GPU a store under
    # the default 256 MiB is copied instead, by design: docs/engine.md)
    engine = make_engine(tiny_model("llama"), paged_decode=paged, block_size=4, kv_preallocate=True, in_place_kv_mb=0)
    live = engine.runner.live
    for k, p in enumerate(PROMPTS):
        engine.add_request(req(f"r{k}", p, greedy(24)))
    while engine.stats().waiting or engine.stats().prefilling:
        engine.step()
    before = buffer_addresses(live.arrays())
    for _ in range(8):
        engine.step()
        assert engine.stats().running == len(PROMPTS)
        assert buffer_addresses(live.arrays()) == before
    while engine.has_work():
        engine.step()


def test_settle_waits_only_for_writes_made_of_mlx_ops(monkeypatch):
    """With in-place writes (CUDA), a pass waits for the one in flight only when an MLX op writes into the
    store (a prefill's scatter, a block copy): a decode pass's own writes never copy the store."""
    import mlx.core as mx

    from parallm.engine.cache import LiveKV

    waits = []
    monkeypatch.setattr(mx, "synchronize", lambda *a: waits.append(1))
    engine = make_engine(tiny_model("llama"))
    live: LiveKV = engine.runner.live
    live.ensure(8)
    live.settle_bytes = 0
    live.settle()
    assert len(waits) == 1  # not in place: every pass waits
    live.writes_in_place = True
    live.settle()
    assert len(waits) == 1  # nothing but in-place writes since
    live.op_written()
    live.settle()
    assert len(waits) == 2
    live.copy_blocks([(1, 2)])
    live.settle()
    assert len(waits) == 3
    live.settle()
    assert len(waits) == 3


@pytest.mark.skipif(__import__("mlx.core").core.cuda.is_available(), reason="off CUDA only")
def test_in_place_writes_need_the_cuda_kernel():
    """Off CUDA the engine never asks for in-place writes, whatever the setting says."""
    engine = make_engine(tiny_model("llama"), kv_write_in_place=True)
    outputs(engine)
    assert engine.runner.pages_decode and not engine.runner.live.writes_in_place


@pytest.mark.skipif(not __import__("mlx.core").core.cuda.is_available(), reason="in-place writes are CUDA's")
def test_in_place_writes_give_the_scatters_tokens_on_cuda(caplog):
    """The same greedy tokens with the decode passes' K/V stored in place as with the scatter (and no
    wait for the pass in flight: a missing ordering edge would show as different tokens)."""
    caplog.set_level(logging.INFO, logger="parallm.engine")
    model = tiny_model("llama")
    want = outputs(make_engine(model, kv_write_in_place=False))
    engine = make_engine(model, kv_write_in_place=True)
    got = outputs(engine)
    assert engine.runner.live.writes_in_place, caplog.text
    assert got == want
