"""Quantized KV (`--kv.bits 8|4`, kv_format.py): the live rows, the prefix pool and the disk tier hold
K/V as mx.quantize stores them, attention reads them through MLX's quantized matmuls (or dequantized,
for a model whose attention is written by hand), and the KV budget buys that many more tokens.

The reference is mlx-lm's own QuantizedKVCache from the first token on: the same quantized K/V and
the same quantized attention, so greedy tokens must agree exactly (spread random weights keep the
logits away from ties)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from parallm.config import Config, ConfigError, EngineConfig, KVConfig, build_config
from parallm.config.loading import parse_args
from parallm.engine import Engine, EngineModel
from parallm.engine.compat import check_model, kv_format_for
from parallm.metrics import ServerMetrics
from parallm.models import tiny
from tests._engine_helpers import greedy, req, run_all, wide_heads_model

GROUP = 32  # the tiny models' heads are 32 wide here (mx.quantize's groups: 32, 64 or 128)
PROMPTS = [[(i * 7 + k) % 97 + 1 for i in range(9 + 6 * k)] for k in range(4)]


def quantized_reference(model, prompt: list[int], max_tokens: int, bits: int) -> list[int]:
    """mlx-lm's greedy tokens with every attention layer's cache a QuantizedKVCache from the start."""
    cache = [QuantizedKVCache(group_size=GROUP, bits=bits) if type(c).__name__ == "KVCache" else c
             for c in make_prompt_cache(model)]
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache)]


def kv_engine(model, bits: int, *, budget_mb: float = 4.0, disk_dir: str = "", group_size: int = GROUP,
              **engine) -> Engine:
    config = Config(engine=EngineConfig(kv_budget_mb=budget_mb, block_size=4, **engine),
                    kv=KVConfig(bits=bits, group_size=group_size, disk_dir=disk_dir, disk_policy="write_through"))
    return Engine(EngineModel(model, (), 512), config)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_tokens_are_mlx_lm_quantized_kv_caches(name, bits):
    model = wide_heads_model(name)
    engine = kv_engine(model, bits, max_prefill_tokens=16)
    assert engine.kv_format.bits == bits and engine.kv_format.read == "matmul"
    forked = req("n2", PROMPTS[2], greedy(10), n=2)
    out = run_all(engine, [req(f"r{k}", p, greedy(10)) for k, p in enumerate(PROMPTS[:2])],
                  arrivals={2: [req("r2", PROMPTS[2], greedy(10)), forked], 4: [req("r3", PROMPTS[3], greedy(10))]})
    for k, p in enumerate(PROMPTS):
        assert out[(f"r{k}", 0)]["tokens"] == quantized_reference(model, p, 10, bits), f"prompt {k}"
    assert out[("n2", 0)]["tokens"] == out[("n2", 1)]["tokens"] == out[("r2", 0)]["tokens"]
    engine.check_integrity()


def test_a_prefix_hit_reads_the_quantized_blocks_as_they_are():
    model = wide_heads_model()
    engine = kv_engine(model, 8)
    cold = run_all(engine, [req("a", PROMPTS[3], greedy(8))])[("a", 0)]["tokens"]
    hot = run_all(engine, [req("b", PROMPTS[3], greedy(8))])[("b", 0)]["tokens"]
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 24 and hot == cold
    live = engine.runner.live  # the one block store: the prefix hit's blocks are its quantized blocks
    assert live.arrays()[0].dtype == mx.uint32 and len(live.arrays()) == 3 * 2 * len(live.shapes)
    assert stats.kv_blocks_cached > 0
    engine.check_integrity()


@pytest.mark.parametrize("option", [{"compiled_decode": True}, {"mixed_passes": True},
                                    {"fast_math": False, "mixed_passes": False}])
def test_every_decode_path_gives_the_same_tokens(option):
    model = wide_heads_model()
    reqs = lambda: [req(f"r{k}", p, greedy(10)) for k, p in enumerate(PROMPTS)]  # noqa: E731
    plain = run_all(kv_engine(model, 8, mixed_passes=False, compiled_decode=False), reqs())
    engine = kv_engine(model, 8, max_prefill_tokens=12, **option)
    out = run_all(engine, reqs()[:2], arrivals={3: reqs()[2:]})
    assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in plain.items()}
    stats = engine.stats()
    if option.get("compiled_decode"):
        assert stats.compiled_decode.get("compiled", 0) > 0
    if option.get("mixed_passes"):
        assert stats.mixed_passes > 0


def test_preemption_recomputes_into_quantized_rows():
    model = wide_heads_model()
    bpt = kv_engine(model, 8).runner.live.bytes_per_token
    engine = kv_engine(model, 8, budget_mb=bpt * 128 / (1 << 20), prefix_pool_fraction=0.25, max_prefill_tokens=16,
                       max_num_seqs=8)  # 96 live token slots for four rows that grow to 27-54 tokens
    prompts = [[(i * 5 + k) % 97 + 1 for i in range(n)] for k, n in enumerate((3, 9, 17, 30))]
    out = run_all(engine, [req(f"t{k}", p, greedy(24)) for k, p in enumerate(prompts)])
    assert engine.stats().preemptions > 0
    for k, p in enumerate(prompts):
        assert out[(f"t{k}", 0)]["tokens"] == quantized_reference(model, p, 24, 8), f"prompt {k}"


def test_a_hybrid_models_state_stays_in_its_dtype():
    model = wide_heads_model("qwen3_next")
    engine = kv_engine(model, 8, max_prefill_tokens=16)
    assert engine.runner.live.layout is not None
    out = run_all(engine, [req(f"r{k}", p, greedy(8)) for k, p in enumerate(PROMPTS)])
    for k, p in enumerate(PROMPTS):
        assert out[(f"r{k}", 0)]["tokens"] == quantized_reference(model, p, 8, 8), f"prompt {k}"
    states = [a for slot in engine.runner.live.states for a in slot if a is not None]
    assert states and all(a.dtype == mx.float32 for a in states)


def test_hand_written_attention_reads_the_kv_dequantized():
    model = wide_heads_model("gemma2")  # its attention splits the GQA heads itself: K/V as arrays
    engine = kv_engine(model, 8)
    assert engine.kv_format.read == "dequantize" and not engine.runner.can_pack
    out = run_all(engine, [req("a", PROMPTS[1], greedy(6))])
    assert len(out[("a", 0)]["tokens"]) == 6


@pytest.mark.parametrize("bits, dtype, at_least", [(8, "float32", 3.5), (4, "float32", 6.0), (8, "bfloat16", 1.88),
                                                   (4, "bfloat16", 3.5)])
def test_the_budget_buys_more_tokens(bits, dtype, at_least):
    """At the default group of 64 (a scale and a bias per 64 elements): 8 bits hold 1.88x the tokens of bfloat16
    K/V (1.94x with groups of 128, for 128-wide heads), 3.56x those of float32; 4 bits 3.56x and 6.4x."""
    model = wide_heads_model(head_dim=64)
    if dtype == "bfloat16":
        model.set_dtype(mx.bfloat16)
    full, quant = kv_engine(model, 0, budget_mb=8), kv_engine(model, bits, budget_mb=8, group_size=64)
    ratio = quant.stats().kv_capacity_tokens / full.stats().kv_capacity_tokens
    assert ratio >= at_least
    assert quant.stats().bytes_per_token == quant.kv_format.bytes_per_token(check_model(model).shapes)
    metrics = ServerMetrics()
    metrics.set_stats(quant.stats())
    assert f"parallm_kv_capacity_tokens {float(quant.stats().kv_capacity_tokens)}" in metrics.render().decode()


def test_the_disk_tier_keeps_quantized_blocks_apart(tmp_path):
    model = wide_heads_model()
    first = kv_engine(model, 8, disk_dir=str(tmp_path))
    cold = run_all(first, [req("a", PROMPTS[3], greedy(6))])[("a", 0)]["tokens"]
    first.close()
    assert first.stats().kv_disk.written >= 6  # 27 prompt tokens: 6 full blocks of 4
    second = kv_engine(model, 8, disk_dir=str(tmp_path))
    assert run_all(second, [req("b", PROMPTS[3], greedy(6))])[("b", 0)]["tokens"] == cold
    assert second.stats().kv_disk.hits == 6 and second.stats().prompt_tokens_computed == 3
    second.check_integrity()
    second.close()
    for bits in (4, 0):  # another fingerprint: the 8-bit files are never read
        other = kv_engine(model, bits, disk_dir=str(tmp_path))
        run_all(other, [req("c", PROMPTS[3], greedy(2))])
        assert other.stats().kv_disk.hits == 0 and other.disk_tier.disk.dir != second.disk_tier.disk.dir
        other.close()


def test_what_cannot_be_quantized_is_refused_naming_the_flag():
    model = tiny.build("llama")[0]  # 16-wide heads: no group of mx.quantize divides them
    with pytest.raises(ValueError, match="--kv.group-size 32"):
        kv_engine(model, 8)
    info = check_model(model)
    assert kv_format_for(model, info, 0, 64).bits == 0
    with pytest.raises(ConfigError, match="KV__BITS: .3. is not one of 0, 4, 8"):
        build_config(environ={"PARALLM_KV__BITS": "3"})
    with pytest.raises(SystemExit):
        parse_args(["--kv.bits", "3"])
    config = parse_args(["--kv.bits", "4", "--kv.group-size", "128"])[0]
    assert (config.kv.bits, config.kv.group_size) == (4, 128)

