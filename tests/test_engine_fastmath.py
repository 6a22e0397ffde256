"""The libm-free exp, SwiGLU and attention of parallm.kernels and parallm.engine.fastmath against MLX's own kernels."""

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import activations, base, llama, qwen3
from mlx_lm.models.rope_utils import Llama3RoPE

from _engine_helpers import greedy, make_engine, run_all, tiny_model, req

from parallm.engine.pass_view import PagedMask
from parallm.engine.packed import TokenPositions
from parallm.engine.fastmath import FastMath, FastRoPE, RopeTables, scaled_dot_product_attention, swiglu
from parallm.kernels import exp
from parallm.protocol import SamplingParams


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def test_exp_matches_libm_over_the_normal_range():
    x = mx.concatenate([mx.linspace(-69.0, 87.0, 200_001), mx.random.normal((10_000,)) * 5])
    assert rel_err(exp(x), mx.exp(x)) < 4e-7


def test_exp_saturates_without_denormals_inf_or_nan():
    low = np.array(exp(mx.array([-mx.inf, -1e30, -1000.0, -200.0, -70.0])))
    high = np.array(exp(mx.array([88.0, 200.0, 1e30, mx.inf])))
    assert np.all(np.isfinite(low)) and np.all(np.isfinite(high))
    assert np.all(low <= 2.0 ** -99) and np.all(low >= np.finfo(np.float32).tiny)  # normal, not 0
    assert np.all(high >= 0.999 * 2.0 ** 126)


@pytest.mark.parametrize("shape", [(1, 1, 7), (16, 1536), (3, 45, 1536)])
def test_swiglu_matches_mlx_lm(shape):
    gate, x = mx.random.normal(shape) * 6, mx.random.normal(shape)
    assert rel_err(swiglu(gate, x), activations.swiglu(gate, x)) < 1e-6
    edge = mx.array([-200.0, -90.0, -20.0, 0.0, 1e-8, 20.0, 90.0, 300.0])
    got, want = np.array(swiglu(edge, mx.ones_like(edge))), np.array(activations.swiglu(edge, mx.ones_like(edge)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


def test_swiglu_leaves_half_precision_to_mlx():
    gate, x = (mx.random.normal((4, 64)) * 4).astype(mx.bfloat16), mx.random.normal((4, 64)).astype(mx.bfloat16)
    assert mx.array_equal(swiglu(gate, x), activations.swiglu(gate, x))


def attention_inputs(B, H, Hk, L, T, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((B, H, L, 16)), mx.random.normal((B, Hk, T, 16)) * 2, mx.random.normal((B, Hk, T, 16)))


def stock(q, k, v, mask):
    return base.scaled_dot_product_attention(q, k, v, None, 0.25, mask)


@pytest.mark.parametrize("B,H,Hk,L,T", [(1, 4, 4, 1, 9), (16, 9, 3, 1, 150), (5, 9, 3, 45, 80), (2, 4, 1, 7, 7)])
def test_attention_matches_mlx_without_mask_and_causal(B, H, Hk, L, T):
    q, k, v = attention_inputs(B, H, Hk, L, T)
    for mask in (None, "causal"):
        got, want = scaled_dot_product_attention(q, k, v, None, 0.25, mask), stock(q, k, v, mask)
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6), mask


def test_attention_per_row_lengths_ignore_whatever_the_masked_keys_hold():
    """Rows of different lengths share a buffer whose unused tail holds stale (here huge) keys,
    as the engine's live KV does: nothing of it may leak into the output."""
    B, H, Hk, L, T = 3, 6, 2, 2, 12
    q, k, v = attention_inputs(B, H, Hk, L, T, seed=1)
    lengths = mx.array([5, 12, 8])
    qpos = lengths[:, None] - L + mx.arange(L)[None]
    mask = (mx.arange(T)[None, None] <= qpos[:, :, None])[:, None]  # [B, 1, L, T]
    stale = mx.arange(T)[None, None, :, None] >= lengths[:, None, None, None]
    k_junk, v_junk = mx.where(stale, 1e4, k), mx.where(stale, 1e6, v)
    got = scaled_dot_product_attention(q, k_junk, v_junk, None, 0.25, mask)
    assert mx.allclose(got, stock(q, k, v, mask), rtol=1e-5, atol=1e-6)
    additive = mx.where(mask, 0.0, -1e9)
    assert mx.allclose(scaled_dot_product_attention(q, k, v, None, 0.25, additive), stock(q, k, v, mask),
                       rtol=1e-5, atol=1e-6)


def test_attention_with_per_head_mask():
    q, k, v = attention_inputs(2, 4, 2, 3, 6, seed=2)
    mask = mx.random.uniform(shape=(2, 4, 3, 6)) > 0.3
    mask[..., 0] = True
    assert mx.allclose(scaled_dot_product_attention(q, k, v, None, 0.25, mask), stock(q, k, v, mask),
                       rtol=1e-5, atol=1e-6)


class _Answers:
    """A cache whose paged read answers a sentinel: only the engine's attention stand-in calls it
    (mlx-lm's stock attention refuses a PagedMask), so a call through the module shows which ran."""

    def paged_attention(self, queries, keys, scale):
        return "stand-in"


def _attends_with_the_stand_in() -> bool:
    q = mx.zeros((1, 2, 1, 8))
    try:
        return llama.scaled_dot_product_attention(q, q, q, cache=_Answers(), scale=1.0,
                                                  mask=PagedMask(None)) == "stand-in"
    except TypeError:  # the stock function: mx.fast.scaled_dot_product_attention takes no PagedMask
        return False


def test_fast_math_swaps_only_while_entered_and_restores_on_error():
    model = tiny_model("llama")
    fm = FastMath(model)
    assert fm.active and set(fm.replaced) == {"swiglu", "scaled_dot_product_attention"}
    assert not _attends_with_the_stand_in()
    with fm:
        assert _attends_with_the_stand_in()
        assert qwen3.swiglu is activations.swiglu  # another architecture's module is left alone
        with fm:
            pass
        assert _attends_with_the_stand_in()  # still inside the outer block
    assert llama.swiglu is activations.swiglu
    with pytest.raises(RuntimeError), fm:
        raise RuntimeError("boom")
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_one_engines_exit_leaves_another_threads_stand_in_in_place():
    """Two engines of one family in one process (a leader and a follower rank): the follower's pass
    ending must not put mlx-lm's stock attention under the leader's pass mid-graph (CI saw a paged
    decode pass reach the stock function with its PagedMask)."""
    leader, follower = FastMath(tiny_model("llama")), FastMath(tiny_model("llama"))
    assert set(follower.replaced) == set(leader.replaced)  # an entered one does not hide the originals
    inside, leave = threading.Event(), threading.Event()
    seen: list[bool] = []

    def follower_pass():
        with follower:
            seen.append(_attends_with_the_stand_in())
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=follower_pass)
    with leader:
        other.start()
        assert inside.wait(10)
        assert FastMath(tiny_model("llama")).replaced == leader.replaced  # built while both are entered
        leave.set()
        other.join(10)
        assert _attends_with_the_stand_in()  # the follower left; the leader's pass still has its stand-in
    assert seen == [True]
    assert not _attends_with_the_stand_in() and llama.swiglu is activations.swiglu


def test_a_thread_without_fast_math_keeps_the_stock_functions_while_another_has_it():
    seen: list[bool] = []
    with FastMath(tiny_model("llama")):
        other = threading.Thread(target=lambda: seen.append(_attends_with_the_stand_in()))
        other.start()
        other.join(10)
        assert _attends_with_the_stand_in()
    assert seen == [False]


ROPES = {
    "plain": lambda: nn.RoPE(16, base=10000.0),
    "partial-scaled": lambda: nn.RoPE(8, base=500.0, scale=0.5),
    "llama3": lambda: Llama3RoPE(16, max_position_embeddings=4096, base=500000.0, scaling_config={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_fast_rope_is_bit_exact_with_mlx_rope(kind):
    """Same tables as MLX's own (CPU) RoPE, built once per pass: the same float32 results."""
    rope = ROPES[kind]()
    fast = FastRoPE(rope, RopeTables())
    for B, H, L in ((16, 9, 1), (3, 4, 45), (1, 2, 7)):
        x = mx.random.normal((B, L, H, 16)).transpose(0, 2, 1, 3)  # as attention hands it over
        for offset in (mx.array(list(range(100, 100 + B))), 37, mx.array(5)):
            assert mx.array_equal(fast(x, offset=offset), rope(x, offset=offset)), (B, H, L, offset)


def test_fast_rope_of_a_packed_pass_rotates_each_token_at_its_own_position():
    rope = nn.RoPE(16, base=10000.0)
    fast = FastRoPE(rope, RopeTables())
    positions = [7, 3, 0, 1, 2, 40]
    x = mx.random.normal((1, 4, len(positions), 16))
    got = fast(x, offset=TokenPositions(mx.array(positions)))
    want = mx.concatenate([rope(x[:, :, j:j + 1], offset=p) for j, p in enumerate(positions)], axis=2)
    assert mx.array_equal(got, want)


def test_fast_rope_leaves_other_inputs_to_the_module():
    rope = nn.RoPE(16, base=10000.0)
    fast = FastRoPE(rope, RopeTables())
    half = mx.random.normal((2, 4, 3, 16)).astype(mx.float16)
    assert mx.array_equal(fast(half, offset=4), rope(half, offset=4))
    with pytest.raises(ValueError):
        fast(half, offset=TokenPositions(mx.array([1, 2, 3])))
    interleaved = tiny_model("llama")
    interleaved.model.layers[0].self_attn.rope = nn.RoPE(16, traditional=True)
    assert len(FastMath(interleaved).ropes) == 1  # only the other layer's rotate-half RoPE is taken


def test_fast_math_swaps_the_rope_modules_only_while_entered():
    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn
    original = attn.rope
    fm = FastMath(model)
    with fm:
        assert isinstance(attn.rope, FastRoPE) and attn.rope.rope is original
        attn.rope(mx.zeros((1, 4, 2, 16)), offset=3)
        assert fm.rope_tables._tables
    assert attn.rope is original and not fm.rope_tables._tables


def test_fast_math_is_a_no_op_for_a_module_without_the_stock_functions():
    class Plain(nn.Module):
        def __call__(self, x):
            return x

    assert not FastMath(Plain()).active


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-sliding"])
def test_engine_tokens_and_logprobs_agree_with_and_without_fast_math(name):
    model = tiny_model(name)
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38][: 3 + i] for i in range(6)]

    def run(fast):
        engine = make_engine(model, fast_math=fast)
        for i, p in enumerate(prompts):
            engine.add_request(req(rid=str(i), prompt_ids=p, params=greedy(12, logprobs=True)))
        return run_all(engine)

    fast, slow = run(True), run(False)
    assert fast.keys() == slow.keys()
    for key in slow:
        assert fast[key]["tokens"] == slow[key]["tokens"]
        np.testing.assert_allclose(fast[key]["logprobs"], slow[key]["logprobs"], rtol=1e-4, atol=1e-5)


def test_warm_up_leaves_nothing_behind():
    model = tiny_model("llama")
    warmed, fresh = make_engine(model), make_engine(model)
    assert warmed.warm_up() > 0
    stats = warmed.stats()
    assert stats.steps == 0 and stats.generated_tokens == 0 and stats.kv_blocks_cached == 0
    assert stats.kv_blocks_used == 0 and warmed.request_ids() == [] and not warmed.has_work()
    sampled = SamplingParams(max_tokens=10, temperature=1.0)  # unseeded: the engine's seed sequence
    outs = []
    for engine in (warmed, fresh):
        engine.add_request(req(rid="a", prompt_ids=[5, 6, 7, 8], params=sampled))
        outs.append(run_all(engine))
    assert outs[0] == outs[1]
    with pytest.raises(RuntimeError):
        fresh.add_request(req(rid="b", prompt_ids=[5, 6], params=sampled))
        fresh.warm_up()


def test_warm_up_fits_a_tiny_context():
    engine = make_engine(tiny_model("llama"), max_model_len=3)
    engine.warm_up()  # requests shrunk to fit (one 1-token prompt generating 2), none refused
    assert not engine.has_work() and engine.stats().steps == 0
    engine.add_request(req(rid="a", prompt_ids=[5], params=greedy(2)))
    assert len(run_all(engine)[("a", 0)]["tokens"]) == 2
