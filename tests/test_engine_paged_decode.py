"""Decode passes read the KV block store through paged attention (pass_view.PagedMask, engine/paged_decode.py)
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

    from parallm.engine import pass_view as view_module
    from parallm.engine.paged_attention import PagedRead

    real = view_module.paged_decode_attention

    def read(queries, k4, v4, paged, scale, way, **kw):
        if fault == "drop_newest_key":
            paged = PagedRead(paged.tables, paged.lengths - 1)
        elif fault == "scale_1.25":
            scale *= 1.25
        return real(queries, k4, v4, paged, scale, way, **kw)

    monkeypatch.setattr(view_module, "paged_decode_attention", read)
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
    assert engine.runner.live.writes_in_place and engine.runner.live.fuses_newest, caplog.text
    assert got == want
    engine = make_engine(model, kv_write_in_place=True)
    assert engine.runner.pages_decode
    engine.runner.live.fuses_newest = False  # the write kernel before attention: where the fused check fails
    assert outputs(engine) == want


def _recorded_kernels(monkeypatch):
    """The CUDA kernels' Python entry points recorded (the kernels run on a GPU only; their numerics are
    tests/test_paged_attention.py's): which one a layer view calls, with what."""
    import mlx.core as mx

    from parallm.engine import paged_kernels

    calls = []

    def write(k_store, v_store, k_new, v_new, slots):
        calls.append(("write",))
        return mx.zeros((1,), dtype=mx.int32)

    def gather_after(k_store, v_store, slots, after):
        calls.append(("gather", after))
        return mx.zeros((2, 2, 6, 8)), mx.zeros((2, 2, 6, 8))

    def attention(queries, k_store, v_store, tables, lengths, scale, splits=None, written=None, newest=None,
                  block_size=None):
        assert k_store.ndim == 3 and block_size == 4  # the stores themselves, no reshape op
        calls.append(("attend", newest, written))
        return mx.zeros(queries.shape)

    monkeypatch.setattr(paged_kernels, "cuda_write", write)
    monkeypatch.setattr(paged_kernels, "cuda_gather_after", gather_after)
    monkeypatch.setattr(paged_kernels, "cuda_attention", attention)
    return calls


def _fused_view():
    import mlx.core as mx

    from parallm.engine.cache import LayerShape, LiveKV
    from parallm.engine.pass_view import PassContext

    live = LiveKV([LayerShape(2, 8, 2, 8)], mx.float32, block_size=4)
    live.writes_in_place = live.fuses_newest = True
    live.resize(2, 16)
    ctx = PassContext(0, [3, 5], 1, 6, tables=[[0, 1], [2, 3]])
    ctx.paged_way = "auto"
    view = live.views(ctx)[0]
    return view, ctx, mx.ones((2, 2, 1, 8)), mx.ones((2, 2, 1, 8)) * 2, mx.ones((2, 4, 1, 8))


def test_fused_writes_hand_the_new_kv_to_the_attention_kernel(monkeypatch):
    """With the store written by the attention kernel (LiveKV.fuses_newest), a layer's update_and_fetch
    stores nothing and returns the new K/V; its attention is one launch that stores them; a KV-sharing layer
    reading the layer's K/V afterwards gets them gathered after that launch."""
    calls = _recorded_kernels(monkeypatch)
    view, ctx, k, v, q = _fused_view()
    got_k, got_v = view.update_and_fetch(k, v)
    assert got_k is k and got_v is v and calls == []
    out = view.paged_attention(q, got_k, 0.1)
    assert [c[0] for c in calls] == ["attend"]
    newest, written = calls[0][1], calls[0][2]
    assert newest[0] is k and newest[1] is v and newest[2] is ctx.write and written is None
    keys, values = view.keys_and_values()
    assert calls[1] == ("gather", out) and keys.shape == (2, 2, 6, 8)
    assert view.keys_and_values()[0] is keys and len(calls) == 2  # gathered once


def test_fused_writes_store_first_where_attention_cannot_read_the_tables(monkeypatch):
    """Attention that takes the gathered K/V (sinks; the stand-ins' fallback asks `fetched`) gets them stored by
    the write kernel first; the paged read of the same layer then only reads, after that write."""
    calls = _recorded_kernels(monkeypatch)
    view, ctx, k, v, q = _fused_view()
    handed = view.update_and_fetch(k, v)
    other = (k + 0, v + 0)
    assert view.fetched(*other) == other and calls == []  # another cache's K/V: untouched
    keys, values = view.fetched(*handed)
    assert [c[0] for c in calls] == ["write", "gather"] and keys.shape == (2, 2, 6, 8)
    flag = calls[1][1]
    view.paged_attention(q, keys, 0.1)
    assert calls[2] == ("attend", None, flag)


def test_prompt_chunks_attend_in_place_only_where_the_probe_passes(monkeypatch):
    """runner.prefills_in_place: on for the CPU's float32 gather_mm way (K as transposed tiles) with the
    gathered tokens; off with paged decode off, with the gather way, for a model with its own attention, and
    where the probe's logits differ (a wrong read is not taken)."""
    from parallm.engine import paged_attention

    model = tiny_model("llama")
    engine = make_engine(model, block_size=4)
    assert engine.runner.prefills_in_place
    assert outputs(engine) == outputs(make_engine(model, paged_decode="off", block_size=4))
    assert not make_engine(model, paged_decode="off").runner.prefills_in_place
    assert not make_engine(model, paged_decode="gather").runner.prefills_in_place
    assert not make_engine(tiny_model("gemma2")).runner.prefills_in_place
    real = paged_attention.gather_mm_prefill_attention
    monkeypatch.setattr(paged_attention, "gather_mm_prefill_attention",
                        lambda queries, *a: real(queries, *a) * 1.5)  # a read that is wrong
    assert not make_engine(model).runner.prefills_in_place


def test_the_warm_up_runs_the_in_place_prefill_probe_so_no_request_step_does():
    """The probe pass (paged_decode.check_paged_prefill) ran inside the first real step whose prompt chunk
    followed a prefix hit: served on the 2-core CPU, a 1.2-1.6 s step every running request waited for."""
    engine = make_engine(tiny_model("llama"), block_size=4)
    assert engine.runner._prefill_in_place is None  # decided on first use
    engine.warm_up()
    assert engine.runner._prefill_in_place is True
    assert not engine.has_work() and engine.stats().steps == 0
