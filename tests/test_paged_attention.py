"""parallm.engine.paged_attention: decode attention through block tables equals the dense rows'
attention (mx.fast.scaled_dot_product_attention with the engine's per-row mask) for ragged rows,
grouped-query heads and both dtypes; each backend's guard picks its way (device queries stubbed);
the Metal and CUDA kernels equal the gather where their device is."""

import mlx.core as mx
import numpy as np
import pytest

from parallm.engine import paged_attention, paged_kernels
from parallm.engine.paged_attention import PagedRead, choose_way, paged_decode_attention


def paged_case(lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: mx.Dtype, block_size: int = 16,
               spare_blocks: int = 5, seed: int = 0):
    """Dense per-row K/V [rows, kv_heads, T, dim] and the same KV in a head-major block store whose
    blocks are handed out in a shuffled order (tables padded with other rows' block ids)."""
    rng = np.random.default_rng(seed)
    rows, span = len(lengths), max(lengths)
    width = -(-span // block_size)
    keys = rng.standard_normal((rows, kv_heads, width * block_size, dim)).astype(np.float32)
    values = rng.standard_normal((rows, kv_heads, width * block_size, dim)).astype(np.float32)
    used = [-(-n // block_size) for n in lengths]
    n_blocks = sum(used) + spare_blocks
    order = rng.permutation(n_blocks)
    k_store = rng.standard_normal((kv_heads, n_blocks, block_size, dim)).astype(np.float32)
    v_store = rng.standard_normal((kv_heads, n_blocks, block_size, dim)).astype(np.float32)
    tables = np.zeros((rows, width), dtype=np.int32)
    nxt = 0
    for r, n in enumerate(used):
        for j in range(n):
            b = order[nxt]
            nxt += 1
            tables[r, j] = b
            k_store[:, b] = keys[r, :, j * block_size:(j + 1) * block_size]
            v_store[:, b] = values[r, :, j * block_size:(j + 1) * block_size]
        tables[r, n:] = rng.integers(0, n_blocks, width - n)  # padding: any block, masked
    queries = rng.standard_normal((rows, heads, 1, dim)).astype(np.float32)
    arr = (lambda a: mx.array(a).astype(dtype))
    return (arr(queries), arr(keys[:, :, :span]), arr(values[:, :, :span]), arr(k_store), arr(v_store),
            mx.array(tables), mx.array(lengths, dtype=mx.int32))


def dense_attention(queries, keys, values, lengths, scale):
    """The dense rows' decode attention as the engine calls it: a boolean mask [rows, 1, 1, T]."""
    span = keys.shape[2]
    mask = (mx.arange(span)[None] < lengths[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


CASES = [
    ([1, 17, 40, 33, 16], 6, 2, 64),  # ragged, GQA 3 query heads per KV head, a row of one key
    ([100] * 4, 4, 4, 32),  # uniform, no GQA
    ([5, 300, 64, 129], 24, 8, 128),  # Llama-3.2-3B's heads and head dim
    ([16, 3], 9, 3, 64),  # every row in one block (a table one entry wide)
]


@pytest.mark.parametrize("way,dtype,tol", [("gather", mx.float32, 2e-5), ("gather", mx.bfloat16, 2e-2),
                                            ("gather_mm", mx.float32, 2e-5)])
@pytest.mark.parametrize("lengths,heads,kv_heads,dim", CASES)
def test_mlx_op_ways_equal_dense_attention(lengths, heads, kv_heads, dim, way, dtype, tol):
    q, keys, values, k_store, v_store, tables, lens = paged_case(lengths, heads, kv_heads, dim, dtype)
    scale = dim ** -0.5
    with mx.stream(mx.cpu):  # exact float32 (a CUDA GPU's float32 matmuls use TF32)
        want = dense_attention(q, keys, values, lens, scale).astype(mx.float32)
    got = paged_decode_attention(q, k_store, v_store, PagedRead(tables, lens), scale, way=way)
    assert got.shape == q.shape and got.dtype == dtype
    assert mx.max(mx.abs(got.astype(mx.float32) - want)).item() < max(tol, _tf32_tolerance(dtype))


def _tf32_tolerance(dtype) -> float:
    """What MLX's float32 matmuls on a CUDA GPU round to (TF32: a 10-bit mantissa, MLX_ENABLE_TF32 on
    by default): ways built of MLX's matmuls are held to it there; the kernels accumulate in float32."""
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    return 2e-3 if on_cuda and dtype == mx.float32 else 0.0


def test_the_cpu_reads_float32_in_place_and_gathers_other_dtypes(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert paged_attention.backend() == "cpu"
    for dtype, way in ((mx.float32, "gather_mm"), (mx.bfloat16, "gather")):
        q, _, _, k_store, _, _, _ = paged_case([20, 3], 6, 2, 64, dtype)
        assert choose_way(q, k_store) == way


@pytest.fixture
def gpu(monkeypatch):
    """Stub MLX's device queries: a GPU is the default device; which backend is set per test."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)

    def answer(metal: bool, cuda: bool) -> None:
        monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
        monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    return answer


def test_the_guard_picks_metal_only_on_apple_silicon_and_the_gather_elsewhere(gpu):
    q, _, _, k_store, _, _, _ = paged_case([20, 3], 6, 2, 64, mx.bfloat16)
    gpu(metal=True, cuda=False)
    assert choose_way(q, k_store) == "metal"
    gpu(metal=False, cuda=True)
    assert choose_way(q, k_store) == "cuda"
    gpu(metal=False, cuda=False)  # a GPU device MLX has neither backend for: the MLX ops
    assert choose_way(q, k_store) == "gather"


def test_shapes_the_kernels_do_not_take_go_to_the_gather(gpu):
    gpu(metal=False, cuda=True)
    wide = mx.zeros((2, 8, 1, 256))  # float32 head dim 256: 64 lanes of 16 bytes, more than a warp
    assert choose_way(wide, mx.zeros((2, 4, 16, 256))) == "gather"
    odd = mx.zeros((2, 8, 1, 72), dtype=mx.bfloat16)
    assert choose_way(odd, mx.zeros((2, 4, 16, 72), dtype=mx.bfloat16)) == "gather"
    assert choose_way(mx.zeros((2, 8, 1, 128), dtype=mx.bfloat16), mx.zeros((2, 4, 16, 128), dtype=mx.bfloat16)) == "cuda"


def test_splits_give_few_long_rows_more_threadblocks():
    assert paged_kernels.auto_splits(rows=1, kv_heads=8, table_width=128) == 1  # 2,048 keys: one launch
    assert paged_kernels.auto_splits(rows=1, kv_heads=8, table_width=512) == 4
    assert paged_kernels.auto_splits(rows=1, kv_heads=8, table_width=8192) == 64
    assert paged_kernels.auto_splits(rows=16, kv_heads=8, table_width=2048) == 4
    assert paged_kernels.auto_splits(rows=256, kv_heads=8, table_width=2048) == 1


def test_bad_shapes_are_refused():
    q, _, _, k_store, v_store, tables, lens = paged_case([20, 3], 6, 2, 64, mx.float32)
    with pytest.raises(ValueError, match="queries"):
        paged_decode_attention(mx.concatenate([q, q], axis=2), k_store, v_store, PagedRead(tables, lens), 0.1)
    with pytest.raises(ValueError, match="rows"):
        paged_decode_attention(q, k_store, v_store, PagedRead(tables[:1], lens[:1]), 0.1)
    with pytest.raises(ValueError, match="lengths"):
        PagedRead(tables, lens[:1])


def _kernel_matches_gather(way: str, **kw) -> None:
    for lengths, heads, kv_heads, dim in CASES + [([2048, 1], 24, 8, 128), ([4096] * 3 + [17], 32, 8, 128)]:
        for dtype, tol in ((mx.float32, 1e-4), (mx.bfloat16, 2e-2)):
            q, _, _, k_store, v_store, tables, lens = paged_case(lengths, heads, kv_heads, dim, dtype)
            scale = dim ** -0.5
            with mx.stream(mx.cpu):  # exact float32 (a CUDA GPU's float32 matmuls use TF32)
                want = paged_decode_attention(q, k_store, v_store, PagedRead(tables, lens), scale, way="gather")
                mx.eval(want)
            if way == "cuda":
                for splits in (1, 3, None):
                    got = paged_kernels.cuda_attention(q, k_store, v_store, tables, lens, scale, splits=splits)
                    diff = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
                    assert diff < tol, (lengths, dtype, splits, diff)
            else:
                got = paged_decode_attention(q, k_store, v_store, PagedRead(tables, lens), scale, way=way)
                assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item() < tol


@pytest.mark.skipif(not mx.metal.is_available(), reason="the Metal kernel runs on Apple silicon only")
def test_metal_kernel_equals_the_gather():
    _kernel_matches_gather("metal")


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the CUDA kernel runs on an NVIDIA GPU only")
def test_cuda_kernel_equals_the_gather():
    _kernel_matches_gather("cuda")


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the CUDA kernel runs on an NVIDIA GPU only")
def test_cuda_in_place_writes_equal_the_scatter_and_order_the_reads():
    """cuda_write stores new tokens through the store's pointer (the store array is the same object
    after it); what it wrote is what a scatter would have stored, and the reads that take its flag (the
    attention kernel, cuda_gather_after) see it within the same evaluation."""
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    for dtype in (mx.float32, mx.bfloat16):
        store = mx.random.normal((kv_heads, 40 * bs, dim)).astype(dtype)
        mx.eval(store)
        reference = mx.array(np.array(store.astype(mx.float32))).astype(dtype)
        slots = mx.array([5 * bs + 3, 17 * bs, 30 * bs + 15], dtype=mx.int32)
        new = mx.random.normal((kv_heads, 3, dim)).astype(dtype)
        reference[:, slots] = new
        read = mx.array([[5 * bs + 3, 17 * bs, 2], [30 * bs + 15, 1, 0]], dtype=mx.int32)
        # V twice as wide as K (the kernels take K's and V's widths apart)
        vstore0 = mx.random.normal((kv_heads, 40 * bs, 2 * dim)).astype(dtype)
        mx.eval(vstore0)
        vreference = mx.array(np.array(vstore0.astype(mx.float32))).astype(dtype)
        vnew = mx.random.normal((kv_heads, 3, 2 * dim)).astype(dtype)
        vreference[:, slots] = vnew
        done = paged_kernels.cuda_write(store, vstore0, new, vnew, slots)
        got, vgot = paged_kernels.cuda_gather_after(store, vstore0, read, done)
        want = mx.take(reference, read, axis=1).transpose(1, 0, 2, 3)
        assert mx.array_equal(got, want).item()
        assert mx.array_equal(vgot, mx.take(vreference, read, axis=1).transpose(1, 0, 2, 3)).item()
        mx.eval(done)
        assert mx.array_equal(store, reference).item()
        assert mx.array_equal(vstore0, vreference).item()
        # the attention kernel reading the store right after the write, in one evaluation
        tables = mx.array([[0, 1, 2], [3, 4, 5]], dtype=mx.int32)
        lens = mx.array([40, 33], dtype=mx.int32)
        store2 = mx.zeros((kv_heads, 7 * bs, dim), dtype=dtype)
        vstore = mx.zeros((kv_heads, 7 * bs, dim), dtype=dtype)
        mx.eval(store2, vstore)
        pos = mx.array([(1 + 2) * bs + 7, (4 + 2) * bs], dtype=mx.int32)  # each row's newest key
        kn = mx.random.normal((kv_heads, 2, dim)).astype(dtype)
        vn = mx.random.normal((kv_heads, 2, dim)).astype(dtype)
        q = mx.random.normal((2, heads, 1, dim)).astype(dtype)
        done = paged_kernels.cuda_write(store2, vstore, kn, vn, pos)
        k4, v4 = (s.reshape(kv_heads, -1, bs, dim) for s in (store2, vstore))
        got = paged_kernels.cuda_attention(q, k4, v4, tables + 1, lens, dim ** -0.5, written=done)
        mx.eval(got)
        want = paged_decode_attention(q, k4, v4, PagedRead(tables + 1, lens), dim ** -0.5, way="gather")
        assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item() < 2e-2
        assert mx.max(mx.abs(want.astype(mx.float32))).item() > 0  # the newest keys were seen


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the CUDA kernel runs on an NVIDIA GPU only")
def test_cuda_fused_kernel_stores_and_attends_each_rows_newest_key():
    """The fused variant (cuda_attention's `newest`): each row's newest K/V, which the lengths count but the
    store does not hold, are attended as the gather attends them once stored, and are stored at the row's
    slot through the store's pointer (the store arrays are the same objects after); queries and newest
    K/V read through their strides (slices of wider arrays), with and without splits, the stores as tiles and as
    the engine's [kv_heads, slots, dim]."""
    for lengths, heads, kv_heads, dim in CASES + [([2048, 1], 24, 8, 128), ([4096] * 3 + [17], 32, 8, 128)]:
        for dtype, rel, tol in ((mx.float32, 0.0, 1e-4), (mx.bfloat16, 2.0 ** -7, 2e-3)):
            for splits, as_slots in ((1, False), (3, True), (None, False), (None, True)):
                q, _, _, k_store, v_store, tables, lens = paged_case(lengths, heads, kv_heads, dim, dtype)
                bs = k_store.shape[2]
                rows = len(lengths)
                table = np.array(tables)
                slots = np.array([table[r, (n - 1) // bs] * bs + (n - 1) % bs for r, n in enumerate(lengths)],
                                 dtype=np.int32)
                wide_k = mx.random.normal((rows, kv_heads, 3, dim)).astype(dtype)
                wide_v = mx.random.normal((rows, kv_heads, 3, dim)).astype(dtype)
                xk, xv = wide_k[:, :, 1:2], wide_v[:, :, 1:2]  # strided: not row-contiguous
                wide_q = mx.concatenate([q, q * 2], axis=2)
                q_strided = wide_q[:, :, 1:2]
                ref_k = np.array(k_store.astype(mx.float32)).reshape(kv_heads, -1, dim)
                ref_v = np.array(v_store.astype(mx.float32)).reshape(kv_heads, -1, dim)
                ref_k[:, slots] = np.array(xk.astype(mx.float32))[:, :, 0].transpose(1, 0, 2)
                ref_v[:, slots] = np.array(xv.astype(mx.float32))[:, :, 0].transpose(1, 0, 2)
                ref_k4 = mx.array(ref_k.reshape(k_store.shape)).astype(dtype)
                ref_v4 = mx.array(ref_v.reshape(v_store.shape)).astype(dtype)
                scale = dim ** -0.5
                with mx.stream(mx.cpu):  # exact float32 over the same (bf16-valued) inputs
                    want = paged_decode_attention((q * 2).astype(mx.float32), ref_k4.astype(mx.float32),
                                                  ref_v4.astype(mx.float32), PagedRead(tables, lens), scale,
                                                  way="gather")
                    mx.eval(want)
                if as_slots:
                    k_store, v_store = k_store.reshape(kv_heads, -1, dim), v_store.reshape(kv_heads, -1, dim)
                mx.eval(k_store, v_store, xk, xv, q_strided)
                k_before, v_before = k_store, v_store
                got = paged_kernels.cuda_attention(q_strided, k_store, v_store, tables, lens, scale, splits=splits,
                                                   newest=(xk, xv, mx.array(slots)), block_size=bs if as_slots else None)
                mx.eval(got)
                # bf16: the output's own rounding (half a unit in the last place, 2**-9 of its size) and the
                # kernel's float32 sums; a bf16 reference rounded its probabilities too and was 1.5 units off
                # at |out| ~ 3 (0.023, seen on the H200), which no kernel error explains
                bound = mx.abs(want) * rel + tol
                excess = mx.max(mx.abs(got.astype(mx.float32) - want) - bound).item()
                assert excess < 0, (lengths, dtype, splits, as_slots, excess)
                assert k_store is k_before and v_store is v_before
                assert mx.array_equal(k_store, ref_k4.reshape(k_store.shape)).item()
                assert mx.array_equal(v_store, ref_v4.reshape(v_store.shape)).item()


@pytest.mark.parametrize("ends,length,heads,kv_heads,dim", [
    ([40, 17, 33], 8, 6, 2, 64),  # ragged chunk ends, GQA
    ([300, 9], 16, 9, 3, 64),  # a long prompt's late chunk beside a short prompt (the default model's heads)
    ([16], 16, 4, 4, 32),  # one row, a chunk filling its only block
])
def test_prompt_chunks_read_in_place_equal_the_gathered_attention(ends, length, heads, kv_heads, dim):
    """gather_mm_prefill_attention (K as transposed tiles) against mx.fast's attention over each row's
    gathered keys under the causal mask of its chunk: row r's chunk is positions ends[r] - length ..
    ends[r] - 1 (a row shorter than the chunk starts at 0 and its queries past its end are padding)."""
    queries, keys, values, k_store, v_store, tables, _ = paged_case(ends, heads, kv_heads, dim, mx.float32,
                                                                    block_size=16)
    queries = mx.random.normal((len(ends), heads, length, dim), key=mx.random.key(1))
    starts = mx.array([max(0, e - length) for e in ends], dtype=mx.int32)
    span = keys.shape[2]
    visible = mx.arange(span)[None, None, :] <= (starts[:, None, None] + mx.arange(length)[None, :, None])
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=visible[:, None])
    read = PagedRead(tables, starts + length)  # each row's chunk ends at its start + the chunk's length
    got = paged_attention.gather_mm_prefill_attention(queries, k_store.swapaxes(-1, -2), v_store, read, 0.125)
    real = [(r, t) for r, e in enumerate(ends) for t in range(min(length, e))]  # padded queries are dropped
    for r, t in real:
        np.testing.assert_allclose(np.array(got[r, :, t]), np.array(want[r, :, t]), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="transposed K tiles"):
        paged_attention.gather_mm_prefill_attention(queries, k_store, v_store, read, 0.125)


@pytest.mark.parametrize("ends,length,groups", [([9, 300, 40, 290], 8, 3), ([5, 40], 8, 2), ([40, 5], 8, 2),
                                                ([40, 60], 8, 1)])
def test_a_passs_rows_attend_in_groups_of_like_spans_in_their_own_order(ends, length, groups):
    """PrefillRead: rows in the pass's order, whatever their spans (one group: the pass's own order; several:
    each group attended over its widest table, the outputs put back in the rows' order)."""
    bs = 16
    queries, keys, values, k_store, v_store, tables, _ = paged_case(ends, 9, 3, 64, mx.float32, block_size=bs)
    queries = mx.random.normal((len(ends), 9, length, 64), key=mx.random.key(2))
    starts = [max(0, e - length) for e in ends]
    lengths = [e - s for e, s in zip(ends, starts)]
    read = paged_attention.PrefillRead(np.array(tables) - 1, starts, lengths, length, bs)  # block ids: store index - 1
    assert len(read.groups) == groups
    span = keys.shape[2]
    visible = mx.arange(span)[None, None, :] <= (mx.array(starts)[:, None, None] + mx.arange(length)[None, :, None])
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=visible[:, None])
    got = read.attend(queries, k_store.swapaxes(-1, -2), v_store, 0.125)
    for r, n in enumerate(lengths):
        np.testing.assert_allclose(np.array(got[r, :, :n]), np.array(want[r, :, :n]), rtol=2e-5, atol=2e-5)
