"""K stored as transposed tiles (parallm.engine.key_tiles, cache.LiveKV(keys_transposed=True)): every
store operation gives what the head-major store gives (writes of decode and prefill passes, the rows'
gathered K, block copies, a block's tile for the disk tier and back, growth), paged decode attention
reads it as it reads the head-major store, and the CPU's engine stores K so for float32 only."""

import mlx.core as mx
import numpy as np
import pytest

from parallm.config import KVConfig
from parallm.engine import key_tiles
from parallm.engine.cache import LayerShape, LiveKV
from parallm.engine.pass_view import PassContext
from parallm.engine.kv_format import KVFormat
from parallm.engine.paged_attention import PagedRead, paged_decode_attention, transposes_keys
from tests._engine_helpers import make_engine, tiny_model, wide_heads_model
from tests.test_paged_attention import CASES, dense_attention, paged_case

H, D, BS = 2, 8, 4


def rand(*shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def pair() -> tuple[LiveKV, LiveKV]:
    """A head-major store and a transposed-K one, two layers, rows of up to 32 tokens."""
    out = []
    for transposed in (False, True):
        kv = LiveKV([LayerShape(H, D, H, D), LayerShape(H, D, H, D)], mx.float32, block_size=BS,
                    keys_transposed=transposed)
        kv.resize(4, 32)
        out.append(kv)
    return out[0], out[1]


def head_major(kv: LiveKV, layer: int) -> mx.array:
    """A layer's K as [heads, slots, dim] whatever the layout."""
    k = kv.keys[layer]
    return k.swapaxes(-1, -2).reshape(k.shape[0], -1, k.shape[2]) if k.ndim == 4 else k


def same_stores(a: LiveKV, b: LiveKV) -> None:
    assert b.keys[0].ndim == 4 and a.keys[0].ndim == 3
    assert a.store_blocks == b.store_blocks and a.kv_bytes == b.kv_bytes
    for i in range(len(a.shapes)):
        assert mx.array_equal(head_major(a, i), head_major(b, i))
        assert mx.array_equal(a.values[i], b.values[i])


def run_pass(kv: LiveKV, ctx: PassContext, seed: int) -> list[tuple[mx.array, mx.array]]:
    out = []
    for i, view in enumerate(kv.views(ctx)):
        n, L = ctx.n, ctx.length
        out.append(view.update_and_fetch(rand(n, H, L, D, seed=seed + i), rand(n, H, L, D, seed=seed + 50 + i)))
    mx.eval(out, kv.arrays())
    return out


def test_writes_and_reads_equal_the_head_major_stores():
    a, b = pair()
    tables = [[3, 0, 7], [1, 5, 2, 9]]
    # a prefill pass of two rows (10 and 13 tokens), then decode steps at their own positions
    passes = [PassContext(0, [0, 0], 13, 13, tables=tables)] + \
             [PassContext(0, [10 + s, 13 + s], 1, 14 + s, tables=tables) for s in range(3)]
    for seed, ctx in enumerate(passes):
        ctx_b = PassContext(ctx.row0, ctx.offset_list, ctx.length, ctx.span, tables=tables)
        got_a, got_b = run_pass(a, ctx, seed * 100), run_pass(b, ctx_b, seed * 100)
        for (ka, va), (kb, vb) in zip(got_a, got_b):
            assert ka.shape == kb.shape == (2, H, ctx.span, D)
            assert mx.array_equal(ka, kb) and mx.array_equal(va, vb)
        same_stores(a, b)


def test_block_copies_tiles_and_growth_equal_the_head_major_stores():
    a, b = pair()
    ctx = lambda: PassContext(0, [0], 12, 12, tables=[[0, 1, 2]])
    run_pass(a, ctx(), 1), run_pass(b, ctx(), 1)
    for kv in (a, b):
        kv.copy_blocks([(1, 6), (2, 4)])
    same_stores(a, b)
    tiles_a, tiles_b = a.read_blocks([1, 6]), b.read_blocks([1, 6])
    for ta, tb in zip(tiles_a, tiles_b):
        for x, y in zip(ta, tb):
            assert x.shape == y.shape == (H, BS, D) and mx.array_equal(x, y)
    for kv in (a, b):  # a block from the disk tier: written as read, here into block 8
        kv.write_block(8, tiles_a[0])
    same_stores(a, b)
    for kv in (a, b):
        kv.ensure(200)  # grown: the content kept
    assert b.store_blocks >= 200 and b.keys[0].shape == (H, b.store_blocks + 1, D, BS)
    same_stores(a, b)


def test_key_tiles_round_trip_and_bad_sizes():
    store = key_tiles.zeros(3, 5 * 4, 6, 4, mx.float32)
    assert store.shape == (3, 5, 6, 4)
    slots = mx.array([4, 9, 19, 0], dtype=mx.int32)
    new = rand(3, 4, 6, seed=3)
    store = key_tiles.write(store, new, key_tiles.write_index(slots, store.shape))
    got = key_tiles.gather(store, slots[None])  # [1, heads, 4, dim]
    assert mx.array_equal(got[0], new)
    back = key_tiles.untile(key_tiles.tile(store, mx.array([1, 2])), 4)
    assert mx.array_equal(back, store[:, 1:3])
    with pytest.raises(ValueError, match="int32"):
        key_tiles.flat_index(slots, (8, 2**20, 128, 16))
    with pytest.raises(ValueError, match="quantized"):
        LiveKV([LayerShape(H, D, H, D)], mx.float32, kv_format=KVFormat(mx.float32, bits=8, group_size=8),
               keys_transposed=True)


@pytest.mark.parametrize("way", ["gather", "gather_mm"])
@pytest.mark.parametrize("lengths,heads,kv_heads,dim", CASES)
def test_paged_attention_reads_transposed_keys_as_head_major_ones(lengths, heads, kv_heads, dim, way):
    q, keys, values, k_store, v_store, tables, lens = paged_case(lengths, heads, kv_heads, dim, mx.float32)
    scale = dim ** -0.5
    read = PagedRead(tables, lens)
    want = dense_attention(q, keys, values, lens, scale)
    k_t = mx.contiguous(k_store.swapaxes(-1, -2))  # [kv_heads, blocks, dim, block_size]
    got = paged_decode_attention(q, k_t, v_store, read, scale, way=way, keys_transposed=True)
    assert mx.max(mx.abs(got - want)).item() < 2e-5
    with pytest.raises(ValueError, match="keys_transposed"):  # head-major K (dim != block size in every case)
        paged_decode_attention(q, k_store, v_store, read, scale, way=way, keys_transposed=True)


def test_the_cpu_engine_transposes_keys_for_float32_gather_mm_only():
    assert transposes_keys("auto", mx.float32, False) and transposes_keys("gather_mm", mx.float32, False)
    assert not transposes_keys("gather", mx.float32, False) and not transposes_keys(None, mx.float32, False)
    assert not transposes_keys("auto", mx.bfloat16, False) and not transposes_keys("auto", mx.float32, True)
    model = tiny_model("llama")
    assert make_engine(model).runner.live.keys_transposed
    assert not make_engine(model, paged_decode="gather").runner.live.keys_transposed
    assert not make_engine(model, paged_decode="off").runner.live.keys_transposed
    assert not make_engine(wide_heads_model(), kv=KVConfig(bits=8, group_size=32)).runner.live.keys_transposed
