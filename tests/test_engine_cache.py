"""The live KV (a block store read through block tables) against mlx-lm's cache protocol (ideas ported
from mlx-lm's test_prompt_cache.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask, create_causal_mask
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache

from parallm.engine.cache import LayerShape, LiveKV
from parallm.engine.pass_view import KVCacheProtocol, PassContext, gather

H, D = 2, 8


def live(rows=4, cap=32, layers=1, block_size=4):
    kv = LiveKV([LayerShape(H, D, H, D)] * layers, mx.float32, block_size=block_size)
    kv.resize(rows, cap)
    return kv


def rand(*shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_view_satisfies_protocol_and_traps():
    kv = live()
    view = kv.views(PassContext(0, [3, 5], 1, 6))[0]
    assert isinstance(view, KVCacheProtocol)
    assert bool(view)  # truthy: mlx-lm asks it for the mask
    assert not hasattr(view, "bits")  # would switch mlx-lm to quantized attention
    assert isinstance(view.offset, mx.array) and view.offset.tolist() == [3, 5]
    assert not can_trim_prompt_cache([view])


def test_decode_update_writes_each_row_at_its_own_position_like_kvcache():
    kv = live(rows=3, cap=16)
    lengths = [0, 4, 9]
    refs = [KVCache() for _ in lengths]
    # fill rows through multi-row prefill passes of different offsets, then decode steps
    for r, n in enumerate(lengths):
        if n:
            k, v = rand(1, H, n, D, seed=r), rand(1, H, n, D, seed=10 + r)
            view = kv.views(PassContext(r, [0], n, n))[0]
            view.update_and_fetch(k, v)
            refs[r].update_and_fetch(k, v)
    for step in range(3):
        offs = [n + step for n in lengths]
        ctx = PassContext(0, offs, 1, max(offs) + 1)
        k, v = rand(3, H, 1, D, seed=100 + step), rand(3, H, 1, D, seed=200 + step)
        keys, values = kv.views(ctx)[0].update_and_fetch(k, v)
        assert keys.shape == (3, H, max(offs) + 1, D)
        for r in range(3):
            rk, rv = refs[r].update_and_fetch(k[r:r + 1], v[r:r + 1])
            n = offs[r] + 1
            assert mx.array_equal(keys[r:r + 1, :, :n], rk)
            assert mx.array_equal(values[r:r + 1, :, :n], rv)


def rows_of(kv, rows, span, layer=0):
    """Rows' keys [n, H, span, D] in the dense layout's tables."""
    ctx = PassContext(rows[0], [0] * len(rows), 1, span)
    ctx.bind(kv)
    return gather(kv.keys[layer], ctx.read)


def test_padded_multi_row_prefill_writes_only_into_own_rows():
    kv = live(rows=5, cap=24)
    marker = rand(1, H, 24, D, seed=9)
    kv.views(PassContext(0, [0], 24, 24))[0].update_and_fetch(marker, marker)
    ctx = PassContext(1, [2, 0, 5], 4, 9)
    k = rand(3, H, 4, D, seed=1)
    keys, _ = kv.views(ctx)[0].update_and_fetch(k, k)
    assert keys.shape == (3, H, 9, D)
    assert mx.array_equal(rows_of(kv, [0], 24)[0], marker[0])  # row 0 untouched
    got = rows_of(kv, [1, 2, 3], 24)
    for i, off in enumerate([2, 0, 5]):
        assert mx.array_equal(got[i, :, off:off + 4], k[i])
    assert mx.array_equal(rows_of(kv, [4], 24)[0], mx.zeros((H, 24, D)))  # row 4 is not in the pass


def test_block_tables_share_blocks_without_copies():
    """Two sequences whose tables start with the same blocks read the same KV (a prefix hit is a
    reference); positions past a table's blocks go to the trash block, never into another's."""
    kv = live(rows=0, cap=0, block_size=4)
    kv.ensure(8)
    prefix = rand(1, H, 8, D, seed=3)
    kv.views(PassContext(0, [0], 8, 8, tables=[[5, 2]]))[0].update_and_fetch(prefix, prefix)
    a, b = rand(2, H, 1, D, seed=4), rand(2, H, 1, D, seed=5)
    ctx = PassContext(0, [8, 8], 1, 9, tables=[[5, 2, 0], [5, 2, 7]])
    keys, values = kv.views(ctx)[0].update_and_fetch(a, b)
    for r in range(2):
        assert mx.array_equal(keys[r, :, :8], prefix[0]) and mx.array_equal(keys[r, :, 8], a[r, :, 0])
        assert mx.array_equal(values[r, :, 8], b[r, :, 0])
    # a pass whose table lacks the block of a pad position writes it to the trash block
    before = mx.array(kv.keys[0])
    kv.views(PassContext(0, [0], 3, 3, tables=[[]]))[0].update_and_fetch(a[:1, :, [0, 0, 0]], a[:1, :, [0, 0, 0]])
    assert mx.array_equal(kv.keys[0][:, 4:], before[:, 4:])  # everything past the trash block's slots


def test_copy_blocks_and_growth_keep_content():
    kv = live(rows=0, cap=0, block_size=4)
    data = rand(1, H, 4, D, seed=6)
    kv.ensure(2)
    kv.views(PassContext(0, [0], 4, 4, tables=[[1]]))[0].update_and_fetch(data, data)
    kv.copy_blocks([(1, 0)])
    assert kv.copied["cow"] == 4 * kv.bytes_per_token
    small = kv.nbytes
    kv.ensure(100)
    assert kv.store_blocks >= 100 and kv.nbytes > small
    for table in ([0], [1]):
        ctx = PassContext(0, [0], 1, 4, tables=[table])
        ctx.bind(kv)
        assert mx.array_equal(gather(kv.keys[0], ctx.read)[0], data[0])


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("length", [1, 5])
def test_mask_matches_mlx_lm_causal_mask_per_row(window, length):
    offs = [0, 4, 11]
    ctx = PassContext(0, offs, length, max(offs) + length)
    view = live(rows=3).views(ctx)[0]
    h = mx.zeros((3, length, 16))
    mask = create_attention_mask(h, view, window_size=window, return_array=True)  # what models call
    assert mask.shape == (3, 1, length, max(offs) + length)
    for r, off in enumerate(offs):
        ref = create_causal_mask(length, off, window_size=window)  # [L, off + L]
        assert mx.array_equal(mask[r, 0, :, :off + length], ref)
        assert not mask[r, 0, :, off + length:].any().item()  # the unused tail is hidden


def test_mask_5d_for_hand_written_gqa_attention():
    ctx = PassContext(0, [1, 2], 1, 3, mask5d=True)
    assert ctx.mask(None).shape == (2, 1, 1, 1, 3)


def test_attention_through_views_equals_per_row_attention():
    offs = [3, 10, 6]
    kv = live(rows=3, cap=16)
    refs = [KVCache() for _ in offs]
    for r, n in enumerate(offs):
        k = rand(1, H, n, D, seed=r)
        kv.views(PassContext(r, [0], n, n))[0].update_and_fetch(k, k * 2)
        refs[r].update_and_fetch(k, k * 2)
    ctx = PassContext(0, offs, 1, max(offs) + 1)
    q, k = rand(3, 2 * H, 1, D, seed=50), rand(3, H, 1, D, seed=51)
    view = kv.views(ctx)[0]
    keys, values = view.update_and_fetch(k, k * 2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3, mask=view.make_mask(1))
    for r in range(3):
        rk, rv = refs[r].update_and_fetch(k[r:r + 1], k[r:r + 1] * 2)
        ref = mx.fast.scaled_dot_product_attention(q[r:r + 1], rk, rv, scale=0.3, mask=None)
        assert mx.allclose(out[r:r + 1], ref, atol=1e-6).item()


def test_resize_keeps_rows_of_state_only():
    kv = live(rows=3, cap=8, layers=2)
    kv.resize(5, 12)
    assert (kv.rows, kv.capacity) == (5, 12) and not kv.keys  # no store until a pass needs one


def test_decode_update_is_in_place():
    """A decode scatter must reuse the buffer: a copy would cost a full read+write of the KV."""
    kv = live(rows=8, cap=4096, layers=1)
    ctx = PassContext(0, [7] * 8, 1, 8)
    ctx.bind(kv)  # the store, grown to the rows' blocks
    before = kv.keys[0].nbytes
    mx.eval(kv.arrays(), ctx.read, ctx.write)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    k = rand(8, H, 1, D)
    keys, _ = kv.views(ctx)[0].update_and_fetch(k, k)
    mx.eval(keys, kv.arrays())
    assert mx.get_peak_memory() - base < before // 2, "decode update copied the KV buffer"


@pytest.mark.parametrize("length", [1, 5])
def test_kv_writes_are_one_scatter_each_and_land_in_the_rows_slots(length):
    """A layer's write is one Scatter over (head, slot) indices built once per pass (no per-layer
    index broadcasts or int64 casts: perf/results/kv-writes-cpu.md)."""
    from tests._graph import primitives

    kv = live(rows=4, cap=32, layers=2)
    ctx = PassContext(1, [3, 7, 0], length, 7 + length)
    ctx.bind(kv)
    mx.eval(kv.arrays())
    for view in kv.views(ctx):
        view.update_and_fetch(rand(3, H, length, D, seed=1), rand(3, H, length, D, seed=2))
    ops = primitives(kv.arrays())
    # one Scatter per write; the (head, slot) indices are built once for the pass (one Arange of the heads)
    assert ops["Scatter"] == 4 and ops["AsType"] == 0 and ops["Arange"] <= 1, ops
    got = rows_of(kv, [1, 2, 3], 32, layer=1)
    for i, off in enumerate([3, 7, 0]):
        assert mx.array_equal(got[i, :, off:off + length], rand(3, H, length, D, seed=1)[i])
