"""The live KV cache against mlx-lm's cache protocol (ideas ported from mlx-lm's test_prompt_cache.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask, create_causal_mask
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache

from parallm.engine.cache import KVCacheProtocol, LayerShape, LiveKV, PassContext
from parallm.engine.pool import KVPool

H, D = 2, 8


def live(rows=4, cap=32, layers=1):
    kv = LiveKV([LayerShape(H, D, H, D)] * layers, mx.float32)
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


def test_padded_multi_row_prefill_writes_only_into_own_rows():
    kv = live(rows=5, cap=24)
    marker = mx.full((H, 24, D), 7.0)
    kv.write_prefix(0, [marker, marker])
    ctx = PassContext(1, [2, 0, 5], 4, 9)
    k = rand(3, H, 4, D, seed=1)
    keys, _ = kv.views(ctx)[0].update_and_fetch(k, k)
    assert keys.shape == (3, H, 9, D)
    full = kv.keys[0]
    assert mx.array_equal(full[0], marker)  # row 0 untouched
    for i, off in enumerate([2, 0, 5]):
        assert mx.array_equal(full[1 + i, :, off:off + 4], k[i])
    assert mx.array_equal(full[4], mx.zeros((H, 24, D)))  # row 4 is not in the pass


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


def test_copy_swap_resize_keep_content():
    kv = live(rows=3, cap=8, layers=2)
    rows = [rand(H, 8, D, seed=i) for i in range(3)]
    for r in range(3):
        kv.write_prefix(r, [rows[r]] * 4)
    kv.copy_rows([(2, 0)], 8)
    assert mx.array_equal(kv.keys[1][0], rows[2])
    kv.copy_rows([(1, 2), (2, 1)], 8)  # swap
    assert mx.array_equal(kv.values[0][1], rows[2]) and mx.array_equal(kv.values[0][2], rows[1])
    kv.resize(5, 12)
    assert kv.keys[0].shape == (5, H, 12, D)
    assert mx.array_equal(kv.keys[0][1, :, :8], rows[2])
    assert mx.array_equal(kv.keys[0][4], mx.zeros((H, 12, D)))
    kv.resize(2, 6)
    assert mx.array_equal(kv.keys[0][0, :, :6], rows[2][:, :6])


def test_pool_round_trip_through_rows():
    shapes = [LayerShape(H, D, H, D)] * 2
    pool = KVPool(shapes, mx.float32, num_blocks=6, block_size=4)
    kv = LiveKV(shapes, mx.float32)
    kv.resize(2, 16)
    data = [rand(H, 12, D, seed=i) for i in range(4)]
    kv.write_prefix(0, data)
    pos = mx.array([4, 5, 6, 7, 0, 1, 2, 3], dtype=mx.int32)  # blocks 1 then 0 of the row
    pool.write([5, 2], kv.read_positions(0, pos))
    back = pool.read_many([[2, 5]])[0]  # block 0 then block 1 of the row
    kv.write_prefix(1, back)
    for buf in kv.arrays():
        assert mx.array_equal(buf[1, :, :8], buf[0, :, :8])


def test_a_prefix_pool_write_does_not_wait_for_the_next_prefix_load():
    """Issue 30: the pool's writes were left lazy until a later prefix load evaluated them all (a 6k-token prompt's
    375 blocks, 0.26 s on the CPU, in a short request's step), holding the written data until then. Started at
    once, the data is the pool's own when the write returns and the device has caught up."""
    shapes = [LayerShape(H, D, H, D)] * 2
    pool = KVPool(shapes, mx.float32, num_blocks=64, block_size=4)
    pool.allocate()
    data = [rand(H, 48 * 4, D, seed=i) for i in range(4)]
    mx.eval(data)
    held = sum(d.nbytes for d in data)
    base = mx.get_active_memory()
    pool.write(list(range(48)), data)
    del data
    mx.synchronize()
    assert base - mx.get_active_memory() >= held  # freed: nothing left for a later load to run
    assert mx.array_equal(pool.read_many([[0]])[0][0], rand(H, 48 * 4, D, seed=0)[:, :4])


def test_decode_update_is_in_place():
    """A decode scatter must reuse the buffer: a copy would cost a full read+write of the KV."""
    kv = live(rows=8, cap=4096, layers=1)
    before = kv.keys[0].nbytes
    mx.eval(kv.arrays())
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    ctx = PassContext(0, [7] * 8, 1, 8)
    k = rand(8, H, 1, D)
    keys, _ = kv.views(ctx)[0].update_and_fetch(k, k)
    mx.eval(keys, kv.arrays())
    assert mx.get_peak_memory() - base < before // 2, "decode update copied the KV buffer"


@pytest.mark.parametrize("length", [1, 5])
def test_kv_writes_are_one_scatter_each_and_land_where_the_slice_form_puts_them(length):
    """`buf[rows, :, positions] = kv` made MLX add an arange, three int64 index casts and their
    broadcasts to every write (5 kernels, twice per layer and pass); write_index's indices, built
    once per pass, leave one Scatter per write."""
    from tests._graph import primitives

    kv = live(rows=4, cap=32, layers=2)
    mx.eval(kv.arrays())
    ctx = PassContext(1, [3, 7, 0], length, 7 + length)
    for view in kv.views(ctx):
        view.update_and_fetch(rand(3, H, length, D, seed=1), rand(3, H, length, D, seed=2))
    ops = primitives(kv.arrays())
    assert ops["Scatter"] == 4 and ops["AsType"] == 0 and ops["Arange"] <= 3, ops  # the pass's rows, heads, positions
    expected = []
    for buf, seed in ((mx.zeros_like(kv.keys[0]), 1), (mx.zeros_like(kv.values[0]), 2)):
        rows = mx.broadcast_to(ctx.rows[:, None], (3, length))
        buf[rows, :, ctx.offsets[:, None] + mx.arange(length)[None]] = rand(3, H, length, D, seed=seed).transpose(0, 2, 1, 3)
        expected.append(buf)
    for layer in range(2):
        assert mx.array_equal(kv.keys[layer], expected[0]) and mx.array_equal(kv.values[layer], expected[1])
