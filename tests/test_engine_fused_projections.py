"""engine.fused_projections: q/k/v and gate/up computed as one matmul each (parallm/engine/fused_projections.py).

Fused and unfused engines give the same greedy tokens on several architectures, with quantized
weights, under LoRA adapters (factored, merged, mixed per row) and after full-weight updates by
name; a decode pass builds fewer matmuls; groups are fused only where the model's forward calls
the siblings on one input."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from parallm.adapters import save_bytes
from parallm.config import EngineConfig, resolve_engine_config
from parallm.engine.matrix import model_modules
from parallm.engine.fused_projections import FusedLinear, FusedProjections, FusedQuantizedLinear
from parallm.models import tiny
from perf.bench_fused_projections import pass_graph

from tests._adapter_helpers import adapter_tensors, lora_model
from tests._engine_helpers import greedy, make_engine, reference_greedy, req, run_all, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [12, 13, 14, 15, 16]]
ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "mistral"]


def _run(engine, prompts=PROMPTS, n=10, adapters=None) -> list[list[int]]:
    adapters = adapters or [""] * len(prompts)
    rid = f"s{engine.stats().steps}-"
    out = run_all(engine, [req(rid=f"{rid}{i}", prompt_ids=p, params=greedy(n), adapter=a)
                           for i, (p, a) in enumerate(zip(prompts, adapters))])
    return [out[(f"{rid}{i}", 0)]["tokens"] for i in range(len(prompts))]


def _groups(engine) -> int:
    return len(engine.runner.fused.groups) if engine.runner.fused is not None else 0


def _quantized(name: str) -> nn.Module:
    model = tiny_model(name)
    nn.quantize(model, group_size=32, bits=8)
    mx.eval(model.parameters())
    return model


def test_groups_are_proven_on_the_forward_and_their_weights_are_views():
    model = tiny_model("llama")
    before = {k: mx.array(v) for k, v in _flat(model).items()}
    fused = FusedProjections(model)
    layers = model.model.layers
    assert len(fused.groups) == 2 * len(layers)
    attn, mlp = layers[0].self_attn, layers[0].mlp
    assert all(type(m) is FusedLinear for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    assert type(attn.o_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
    assert {g.leader for g in fused.groups} == {0}  # q_proj and gate_proj are called first
    after = _flat(model)
    assert after.keys() == before.keys() and all(mx.array_equal(after[k], before[k]).item() for k in after)


def _flat(model: nn.Module) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))


@pytest.mark.parametrize("name", ARCHS + ["phi3"])
def test_a_forward_gives_the_unfused_logits(name):
    model = tiny_model(name)
    x = mx.array([PROMPTS[0]])
    want = model(x, cache=make_prompt_cache(model))
    fused = FusedProjections(model)
    assert len(fused.groups) == (0 if name == "phi3" else 2 * len(model.layers))  # phi3: qkv_proj, gate_up_proj
    with fused:
        got = model(x, cache=make_prompt_cache(model))
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
    assert mx.array_equal(model(x, cache=make_prompt_cache(model)), want).item()  # outside a pass: the plain layers


def test_siblings_on_other_inputs_are_not_fused_or_compute_their_own():
    """A parent whose q/k/v take different inputs is not fused; a fused sibling called on another
    array than its leader's is exact (its own weight)."""
    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

        def __call__(self, x, cache=None):
            y = x[:, :, :8] * 2.0
            return mx.concatenate([self.q_proj(y), self.k_proj(y[:, :, :8] + 1.0), self.v_proj(y)], axis=-1)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.layers = [Cross()]

        def __call__(self, tokens, cache=None):
            return self.layers[0](self.embed(tokens))

    model = Model()
    assert FusedProjections(model).groups == []
    assert type(model.layers[0].q_proj) is nn.Linear

    llama = tiny_model("llama")
    fused = FusedProjections(llama)
    attn = llama.model.layers[0].self_attn
    x, other = mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    with fused:
        q, k = attn.q_proj(x), attn.k_proj(other)
    assert mx.allclose(q, x @ attn.q_proj.weight.T, atol=1e-5).item()
    assert mx.allclose(k, other @ attn.k_proj.weight.T, atol=1e-5).item()


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_tokens_match_unfused_and_mlx_lm(name):
    fused = make_engine(tiny_model(name), max_num_seqs=4, fused_projections=True)
    plain = make_engine(tiny_model(name), max_num_seqs=4, fused_projections=False)
    assert _groups(fused) == 2 * len(fused.model.layers) and _groups(plain) == 0
    assert fused.config.fused_projections and not plain.config.fused_projections
    got = _run(fused)
    assert got == _run(plain)
    assert got[0] == reference_greedy(tiny_model(name), PROMPTS[0], 10)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_quantized_weights_fuse_and_match(name):
    fused = make_engine(_quantized(name), max_num_seqs=4, fused_projections=True)
    plain = make_engine(_quantized(name), max_num_seqs=4, fused_projections=False)
    assert _groups(fused) == 2 * len(fused.model.layers)
    q = fused.model.layers[0].self_attn.q_proj
    assert type(q) is FusedQuantizedLinear and isinstance(q, nn.QuantizedLinear)
    assert _run(fused) == _run(plain)


def test_a_decode_pass_builds_three_fewer_matmuls_a_layer():
    counts = {}
    for on in (False, True):
        engine = make_engine(tiny_model("llama"), max_num_seqs=4, fused_projections=on)
        engine.add_request(req(rid="g", prompt_ids=PROMPTS[1], params=greedy(8)))
        engine.step()
        engine.step()
        assert engine.stats().running == 1 and not engine.stats().prefilling
        counts[on] = pass_graph(engine)  # a decode pass's
    layers = 2
    assert counts[False]["Matmul"] - counts[True]["Matmul"] == 3 * layers
    assert counts[True]["Split"] == 2 * layers
    assert sum(counts[True].values()) < sum(counts[False].values())


@pytest.mark.parametrize("merge_mb", [0, 256], ids=["factored", "merged"])
def test_adapters_give_the_same_tokens_fused(merge_mb):
    """A LoRA on q/v/down (and a mixed batch of the adapter and the base model): each projection's
    delta on its own columns; merged copies work as before."""
    ref = tiny_model("llama")
    config = lora_model(ref, rank=4, keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"))
    blob = save_bytes(adapter_tensors(ref))
    engines = [make_engine(tiny_model("llama"), max_num_seqs=4, adapter_merge_mb=merge_mb, fused_projections=on)
               for on in (True, False)]
    for engine in engines:
        loaded = engine.load_adapter("pol", config=config, weights=blob)
        assert loaded.merged == bool(merge_mb)
    assert _groups(engines[0]) == 4
    want = reference_greedy(ref, PROMPTS[0], 10)
    alone = [_run(e, prompts=PROMPTS[:1], adapters=["pol"]) for e in engines]
    assert alone[0] == alone[1] == [want]
    mixed = [_run(e, adapters=["pol", "", "pol"]) for e in engines]
    assert mixed[0] == mixed[1]
    assert mixed[0][0] == want and mixed[0][1] == reference_greedy(tiny_model("llama"), PROMPTS[1], 10)
    assert engines[0].stats().adapters.passes["mixed"] > 0


def test_weight_updates_by_name_land_in_the_fused_projections():
    """New q_proj / up_proj weights by their Hugging Face names: the fused pass uses them (the group
    concatenates again), as an unfused engine and mlx-lm on the same new weights do."""
    new = {}
    mx.random.seed(7)
    src = tiny_model("llama")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.layers.1.self_attn.v_proj.weight"):
        shape = dict(_flat(src))[name].shape
        new[name] = mx.random.normal(shape) * 0.5
    ref = tiny_model("llama")
    ref.load_weights(list(new.items()), strict=False)
    fused = make_engine(tiny_model("llama"), max_num_seqs=4, fused_projections=True)
    plain = make_engine(tiny_model("llama"), max_num_seqs=4, fused_projections=False)
    before = _run(fused)
    builds = sum(g.builds for g in fused.runner.fused.groups)
    for engine in (fused, plain):
        engine.update_weights(tensors=dict(new))
    q = fused.model.layers[0].self_attn.q_proj
    assert mx.array_equal(q.weight, new["model.layers.0.self_attn.q_proj.weight"]).item()
    got = _run(fused)
    assert sum(g.builds for g in fused.runner.fused.groups) == builds + 3  # the three touched groups only
    assert got == _run(plain) != before
    assert got[0] == reference_greedy(ref, PROMPTS[0], 10)
    assert mx.array_equal(q.weight, new["model.layers.0.self_attn.q_proj.weight"]).item()


def test_compiled_decode_traces_with_fused_projections_on():
    fused = make_engine(tiny_model("llama"), max_num_seqs=4, fused_projections=True, compiled_decode=True)
    plain = make_engine(tiny_model("llama"), max_num_seqs=4, fused_projections=False)
    assert _run(fused) == _run(plain)
    stats = fused.stats().compiled_decode
    assert stats.get("compiled", 0) > 0 and not any(k.startswith("eager_untraceable") for k in stats), stats


def test_device_defaults_and_tensor_parallel():
    assert [resolve_engine_config(EngineConfig(), d).fused_projections for d in ("cpu", "cuda", "metal")] == \
        [False, True, False]  # the CPU's one-row step measured no gain (docs/performance.md)
    assert resolve_engine_config(EngineConfig(fused_projections=True), "metal").fused_projections
    assert not resolve_engine_config(EngineConfig(fused_projections=False), "cuda").fused_projections
    assert not resolve_engine_config(EngineConfig(tensor_parallel=2), "cuda").fused_projections
    assert not resolve_engine_config(EngineConfig(tensor_parallel=2, fused_projections=True), "cuda").fused_projections


@pytest.mark.slow
def test_every_tiny_architecture_gives_its_unfused_logits():
    """The probe on every mlx-lm text architecture parallm.models.tiny builds: whatever it fuses,
    a forward gives the unfused logits."""
    fused_any = 0
    for name in model_modules():
        try:
            model, _ = tiny.build(name)
            x = mx.array([[5, 6, 7, 8]])
            want = model(x, cache=make_prompt_cache(model))
            mx.eval(want)
        except (Exception, SystemExit):  # noqa: BLE001 - an architecture the tiny configs cannot run: nothing to compare
            continue
        fused = FusedProjections(model)
        fused_any += bool(fused.groups)
        with fused:
            got = model(x, cache=make_prompt_cache(model))
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), name
        fused.remove()
    assert fused_any >= 100  # of the 122 that build here (mlx-lm 0.32.2): 105


def test_tensor_parallel_slices_are_never_fused():
    from parallm.engine.distributed import shard_model

    model = tiny_model("llama")
    shard_model(model, mx.distributed.init())  # a group of one: mlx-lm's sharded layers all the same
    assert type(model.model.layers[0].self_attn.q_proj) is nn.AllToShardedLinear
    assert FusedProjections(model).groups == []


@pytest.mark.parametrize("device", ["cuda", "metal", "cpu"])
def test_engine_resolves_its_backend_default(monkeypatch, device):
    from parallm.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "compute_device", lambda: device)
    engine = make_engine(tiny_model("llama"), max_num_seqs=4)
    assert engine.stats().settings["fused_projections"] == (device == "cuda") == (engine.runner.fused is not None)
    assert _run(engine, prompts=PROMPTS[:1])[0] == reference_greedy(tiny_model("llama"), PROMPTS[0], 10)


def test_a_member_that_no_longer_matches_turns_its_group_off():
    """A bias added to one member after install (its siblings have none): the group stops fusing and
    every member computes its own product, exactly."""
    model = tiny_model("llama")
    fused = FusedProjections(model)
    attn = model.model.layers[0].self_attn
    attn.k_proj.bias = mx.ones((attn.k_proj.weight.shape[0],))
    x = mx.array([PROMPTS[0]])
    with fused:
        got = model(x, cache=make_prompt_cache(model))
    assert [g.on for g in fused.groups].count(False) == 1 and not attn.k_proj._fused_group.on
    assert mx.allclose(got, model(x, cache=make_prompt_cache(model)), atol=1e-5).item()
