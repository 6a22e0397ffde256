"""The engine's unset settings resolved per backend (config.resolve_engine_config): on CUDA masked
decode and short prefills attend unfused (docs/performance.md has the H200 figures); the CPU's and
Metal's resolutions are what they were before."""

import mlx.core as mx
import msgspec
import pytest

from parallm import device as device_module
from parallm.config import (CUDA_PREFILL_ROWS, CUDA_PREFILL_TOKENS, CUDA_UNFUSED_PREFILL_KEYS, PREFILL_ROWS, EngineConfig,
                            auto_prefill_tokens, resolve_engine_config)
from parallm.engine import engine as engine_module
from parallm.engine import fastmath, memory

from _engine_helpers import greedy, make_engine, reference_greedy, req, run_all, tiny_model

CPU_BEFORE = {"overlap": False, "fast_math": True, "mixed_passes": True, "prefill_buckets": False,
              "unfused_decode": False, "unfused_prefill_keys": 0}  # the CPU's resolution before CUDA's defaults


def _resolved(device: str, **given) -> dict:
    config = resolve_engine_config(EngineConfig(**given), device)
    return {name: getattr(config, name) for name in CPU_BEFORE}


def test_cpu_resolution_is_unchanged():
    assert _resolved("cpu") == CPU_BEFORE
    unset = msgspec.structs.asdict(EngineConfig())
    resolved = msgspec.structs.asdict(resolve_engine_config(EngineConfig(), "cpu"))
    assert {k: v for k, v in resolved.items() if v != unset[k]} == {
        **{k: v for k, v in CPU_BEFORE.items() if unset[k] is None}, "prefill_pass_s": 0.25,  # issue 30's pacing
        "kv_preallocate": False,  # issue 41: the block store grows as it is used (allocated whole on CUDA)
        "kv_write_in_place": False,  # issue 41: decode passes store K/V in place only through the CUDA kernel
        "block_size": 32,  # issue 41: gather_mm reads 32-token tiles faster than 16 on the CPU
        "prefix_partial_blocks": True,  # issue 37: 32-token blocks' prefix hits to the token (a copied block)
        "fused_projections": False,  # issue 37: one matmul for q/k/v and gate/up, no gain measured on the CPU
        "max_prefill_rows": 16,  # the one default before issue 37 made it 32 on CUDA
        "admit_delay_factor": 0.0,  # issue 37: admissions wait for a fuller pass only where measured
        "warm_decode_rows": 0}  # issue 37: the warm-up's decode-row ramp only where measured


def test_blocks_are_32_tokens_on_the_cpu_and_16_on_gpus_unless_set():
    assert [resolve_engine_config(EngineConfig(), d).block_size for d in ("cpu", "cuda", "metal")] == [32, 16, 16]
    assert [resolve_engine_config(EngineConfig(block_size=16), d).block_size for d in ("cpu", "cuda")] == [16, 16]


def test_partial_block_hits_are_the_cpus_unless_set():
    assert [resolve_engine_config(EngineConfig(), d).prefix_partial_blocks for d in ("cpu", "cuda", "metal")] == \
        [True, False, False]
    assert resolve_engine_config(EngineConfig(prefix_partial_blocks=True), "cuda").prefix_partial_blocks


def test_cuda_admits_32_prompts_and_2048_tokens_a_step_unless_set():
    assert [resolve_engine_config(EngineConfig(), d).max_prefill_rows for d in ("cpu", "cuda", "metal")] == \
        [PREFILL_ROWS, CUDA_PREFILL_ROWS, PREFILL_ROWS] == [16, 32, 16]
    assert resolve_engine_config(EngineConfig(max_prefill_rows=8), "cuda").max_prefill_rows == 8
    assert [auto_prefill_tokens("cuda", False), auto_prefill_tokens("metal", False), auto_prefill_tokens("cpu", True),
            auto_prefill_tokens("cpu", False)] == [CUDA_PREFILL_TOKENS, 512, 128, 256]
    assert CUDA_PREFILL_TOKENS == 2048


def test_engine_on_cuda_resolves_its_prefill_budget_for_cuda(monkeypatch):
    monkeypatch.setattr(engine_module, "compute_device", lambda: "cuda")
    settings = make_engine(tiny_model("llama3-rope")).stats().settings
    assert (settings["max_prefill_tokens"], settings["max_prefill_rows"]) == (CUDA_PREFILL_TOKENS, CUDA_PREFILL_ROWS)


def test_max_prefill_rows_below_one_is_refused():
    from parallm.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="max_prefill_rows"):
        build_config(environ={}, overrides={"engine": {"max_prefill_rows": 0}})


def test_in_place_kv_writes_are_on_only_with_cuda():
    assert [resolve_engine_config(EngineConfig(), d).kv_write_in_place for d in ("cpu", "cuda", "metal")] == \
        [False, True, False]
    assert resolve_engine_config(EngineConfig(kv_write_in_place=False), "cuda").kv_write_in_place is False


def test_prefill_pacing_is_on_only_on_the_cpu():
    assert [resolve_engine_config(EngineConfig(), d).prefill_pass_s for d in ("cpu", "cuda", "metal")] == [0.25, 0, 0]
    assert resolve_engine_config(EngineConfig(prefill_pass_s=0.5), "cuda").prefill_pass_s == 0.5


def test_cuda_attends_unfused_and_metal_keeps_mlx_calls():
    gpu = {"overlap": True, "fast_math": False, "mixed_passes": False, "prefill_buckets": False}
    assert _resolved("cuda") == {**gpu, "unfused_decode": True, "unfused_prefill_keys": CUDA_UNFUSED_PREFILL_KEYS}
    assert CUDA_UNFUSED_PREFILL_KEYS == 4096
    assert _resolved("metal") == {**gpu, "unfused_decode": False, "unfused_prefill_keys": 0}


@pytest.mark.parametrize("device", ["cpu", "cuda", "metal"])
def test_given_settings_win_on_every_device(device):
    got = _resolved(device, unfused_decode=False, unfused_prefill_keys=0)
    assert (got["unfused_decode"], got["unfused_prefill_keys"]) == (False, 0)
    got = _resolved(device, unfused_decode=True, unfused_prefill_keys=64)
    assert (got["unfused_decode"], got["unfused_prefill_keys"]) == (True, 64)


@pytest.mark.parametrize(("default", "cuda", "want"), [("cpu", False, "cpu"), ("cpu", True, "cpu"),
                                                       ("gpu", True, "cuda"), ("gpu", False, "metal")])
def test_compute_device_reads_mlx(monkeypatch, default, cuda, want):
    monkeypatch.setattr(mx, "default_device", lambda: getattr(mx, default))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    assert device_module.compute_device() == want


def test_engine_on_cuda_runs_the_unfused_forms_with_the_stock_tokens(monkeypatch):
    """The engine asks compute_device once and reports what it resolved; with the query answering
    "cuda" (here on MLX's CPU device) it runs masked decode and prefills unfused and keeps mlx-lm's
    greedy tokens; unstubbed on this CPU it keeps MLX's calls."""
    model = tiny_model("llama3-rope")
    model.set_dtype(mx.bfloat16)
    prompts = [[(5 * i + 3 * j) % 89 + 2 for j in range(n)] for i, n in enumerate((6, 13, 3))]

    cpu = make_engine(model, max_prefill_tokens=24)
    assert (cpu.config.unfused_decode, cpu.config.unfused_prefill_keys) == (False, 0)
    assert not cpu.runner.unfused_decode and not cpu.runner.unfused_prefill

    calls: list[int] = []
    real = fastmath.unfused_sdpa
    monkeypatch.setattr(fastmath, "unfused_sdpa", lambda q, *a: (calls.append(q.shape[2]), real(q, *a))[1])
    monkeypatch.setattr(engine_module, "compute_device", lambda: "cuda")
    cuda = make_engine(model, max_prefill_tokens=24)
    settings = cuda.stats().settings
    assert (settings["unfused_decode"], settings["unfused_prefill_keys"]) == (True, CUDA_UNFUSED_PREFILL_KEYS)
    assert cuda.runner.unfused_decode and cuda.runner.unfused_prefill
    reqs = [req(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts)]
    out = run_all(cuda, reqs[:1], arrivals={2: reqs[1:]})
    for i, p in enumerate(prompts):
        assert out[(f"r{i}", 0)]["tokens"] == reference_greedy(model, p, 6), i
    assert 1 in calls and max(calls) > 1  # decode under a mask and prefills both went unfused


def test_float32_is_judged_as_tf32_on_cuda(monkeypatch):
    """MLX's CUDA float32 matmuls use TF32: the start-up checks of a float32 model (compat, the paged read)
    take the 16-bit tolerance there, unless MLX_ENABLE_TF32=0; the CPU's and Metal's float32 is exact."""
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    for backend, exact in (("cpu", True), ("metal", True), ("cuda", False)):
        monkeypatch.setattr(device_module, "compute_device", lambda b=backend: b)
        assert device_module.exact_float32() is exact
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert device_module.exact_float32() is True
