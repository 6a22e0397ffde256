"""LoRA on MoE expert projections (parallm.adapters.switch_lora): adapters trained the way mlx-lm
trains them on a MoE model (`linear_to_lora_layers` -> LoRASwitchLinear, lora_a [E, r, in],
lora_b [E, out, r]) load through every adapter path and apply per row in mixed batches: each
row's greedy tokens equal mlx-lm's own LoRA model decoding alone, and that row served alone."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from _adapter_helpers import adapter_tensors, lora_model, save_mlx
from _engine_helpers import greedy, make_engine, reference_greedy, req, run_all
from mlx_lm.models.switch_layers import SwitchLinear

from parallm import protocol
from parallm.adapters import AdapterError, save_bytes
from parallm.engine import UnsupportedModel
from parallm.models import tiny
from parallm.models.preload import load_adapters_at_start
from parallm.stages.engine import load_adapter as publish

# module -> what its MoE block exercises
FAMILIES = {
    "qwen3_moe": "SwitchGLU, softmax top-k routing",
    "qwen3_moe+q4": "the same with 4-bit QuantizedSwitchLinear experts",
    "gpt_oss": "SwitchGLU with biases and a clamped SwiGLU, sliding attention + sinks",
    "phixtral": "SwitchMLP (fc1 / fc2)",
    "olmoe": "the block flattens its rows before routing",
}


def build(name: str) -> nn.Module:
    model, _ = tiny.build_any(name.removesuffix("+q4"))
    if name.endswith("+q4"):
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    return model


def expert_keys(model: nn.Module) -> list[str]:
    """Every expert projection of a layer, as mlx-lm's lora_parameters.keys name them."""
    return sorted({p for layer in model.layers for p, m in layer.named_modules()
                   if isinstance(m, SwitchLinear) or type(m).__name__ == "QuantizedSwitchLinear"})


def adapted(name: str, *, seed: int, rank: int, extra: tuple[str, ...] = ()) -> tuple[nn.Module, dict]:
    """A copy of the model turned into mlx-lm's own LoRA model (experts, plus `extra` dense keys)."""
    model = build(name)
    config = lora_model(model, keys=tuple(expert_keys(model)) + extra, seed=seed, rank=rank, spread=0.3)
    return model, config


def _prompts(lengths) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(tiny.V) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_mixed_batch_rows_equal_mlx_lm_lora_and_alone(name, tmp_path):
    base = build(name)
    one, cfg_one = adapted(name, seed=1, rank=4)
    dense = ("self_attn.q_proj",) if name in ("qwen3_moe", "olmoe") else ()
    two, cfg_two = adapted(name, seed=2, rank=8, extra=dense)
    engine = make_engine(base, max_prefill_tokens=64, block_size=4)
    # --adapter NAME=PATH at start, and the trainer's publish (weights inline)
    assert load_adapters_at_start(engine, [f"one={save_mlx(one, cfg_one, tmp_path / 'one')}"]) == ["one"]
    publish(engine, protocol.AdapterPublish(name="two", config=cfg_two, weights=save_bytes(adapter_tensors(two))))

    prompts = _prompts((5, 17, 30, 9, 12))
    which = [None, "one", "two", "one", "two"]
    models = {None: base, "one": one, "two": two}
    refs = [reference_greedy(models[w], p, 8) for w, p in zip(which, prompts)]
    assert refs[1] != reference_greedy(base, prompts[1], 8) and refs[2] != reference_greedy(base, prompts[2], 8), \
        "the adapters must change the tokens for this test to mean anything"

    reqs = [req(f"r{i}", p, greedy(8), **({"adapter": w} if w else {})) for i, (w, p) in enumerate(zip(which, prompts))]
    res = run_all(engine, reqs[:2], arrivals={2: reqs[2:4], 4: reqs[4:]})
    assert engine.adapters.router.passes["mixed"] > 0
    for i, ref in enumerate(refs):
        assert res[(f"r{i}", 0)]["tokens"] == ref, f"{name}: row {i} under {which[i]} differs from mlx-lm's LoRA model"
    for i in (1, 2):  # each adapted row served alone (the single-adapter path)
        alone = run_all(engine, [req(f"alone{i}", prompts[i], greedy(8), adapter=which[i])])
        assert alone[(f"alone{i}", 0)]["tokens"] == refs[i], f"{name}: row {i} alone"


def test_an_adapter_loaded_by_path_as_over_http(tmp_path):
    """/v1/adapters sends a path the engine stage checks against adapters.allowed_dirs."""
    base = build("mixtral")
    one, cfg = adapted("mixtral", seed=3, rank=4)
    path = save_mlx(one, cfg, tmp_path / "a")
    engine = make_engine(base, block_size=4)
    publish(engine, protocol.AdapterPublish(name="a", path=str(path)), roots=[str(tmp_path)])
    prompt = _prompts((11,))[0]
    res = run_all(engine, [req("r", prompt, greedy(8), adapter="a"), req("b", prompt, greedy(8))])
    assert res[("r", 0)]["tokens"] == reference_greedy(one, prompt, 8)
    assert res[("b", 0)]["tokens"] == reference_greedy(base, prompt, 8)


def _peft_per_expert(tensors: dict[str, mx.array], config: dict, skip_expert: int | None = None) -> tuple[dict, bytes]:
    """The adapter as PEFT writes it on the Hugging Face model, whose experts are separate linears:
    `...mlp.experts.<e>.gate_proj.lora_A.weight` [r, in] and `lora_B.weight` [out, r]."""
    lp = config["lora_parameters"]
    out = {}
    for key, value in tensors.items():
        module, leaf = key.rsplit(".", 1)
        name = {"lora_a": "lora_A", "lora_b": "lora_B"}[leaf]
        block, proj = module.rsplit(".switch_mlp.", 1)
        for e in range(value.shape[0]):
            if e != skip_expert:
                out[f"base_model.model.{block}.experts.{e}.{proj}.{name}.weight"] = value[e]
    cfg = {"peft_type": "LORA", "r": lp["rank"], "lora_alpha": lp["scale"] * lp["rank"],
           "target_modules": ["gate_proj", "up_proj", "down_proj"], "bias": "none"}
    return cfg, save_bytes(out)


def test_a_peft_adapter_naming_each_expert_is_stacked_onto_the_expert_layers():
    one, cfg = adapted("qwen3_moe", seed=4, rank=4)
    tensors = adapter_tensors(one)
    engine = make_engine(build("qwen3_moe"), block_size=4)
    engine.load_adapter("peft", **dict(zip(("config", "weights"), _peft_per_expert(tensors, cfg))))
    prompt = _prompts((13,))[0]
    res = run_all(engine, [req("r", prompt, greedy(8), adapter="peft")])
    assert res[("r", 0)]["tokens"] == reference_greedy(one, prompt, 8)
    # an expert the adapter leaves out gets no update; the others keep their own index
    key = "model.layers.0.mlp.switch_mlp.up_proj"
    engine.load_adapter("missing", **dict(zip(("config", "weights"), _peft_per_expert(tensors, cfg, skip_expert=2))))
    got = engine.adapters.latest("missing").modules[key]
    assert float(mx.abs(got.b[2]).max()) == 0.0 and float(mx.abs(got.a[2]).max()) == 0.0
    assert bool(mx.array_equal(got.b[3], tensors[f"{key}.lora_b"][3].T))


def _tensors(name: str = "qwen3_moe") -> tuple[dict[str, mx.array], dict]:
    one, cfg = adapted(name, seed=1, rank=4)
    return adapter_tensors(one), cfg


def _rejected(match: str, tensors: dict, cfg: dict) -> None:
    engine = make_engine(build("qwen3_moe"), block_size=4)
    with pytest.raises(AdapterError, match=match):
        engine.load_adapter("bad", config=cfg, weights=save_bytes(tensors))
    assert engine.adapters.latest("bad") is None


def test_keys_the_engine_cannot_apply_are_refused_naming_the_layer():
    tensors, cfg = _tensors()
    key = "model.layers.1.mlp.switch_mlp.up_proj"
    # expert count of the base model differs
    bad = {**tensors, f"{key}.lora_a": tensors[f"{key}.lora_a"][:3], f"{key}.lora_b": tensors[f"{key}.lora_b"][:3]}
    _rejected(rf"{key} has 3 experts .* but 4 experts", bad, cfg)
    # an expert update on a dense layer, a dense update on an expert layer
    q = "model.layers.1.self_attn.q_proj"
    _rejected(rf"{q} holds an expert layer's update .* is a Linear",
              {**tensors, f"{q}.lora_a": mx.zeros((4, 4, 64)), f"{q}.lora_b": mx.zeros((4, 64, 4))},
              {**cfg, "lora_parameters": {**cfg["lora_parameters"], "keys": None}})
    _rejected(rf"{key} is an expert layer \(4 experts\) but its update has lora_a \(64, 4\)",
              {**tensors, f"{key}.lora_a": mx.zeros((64, 4)), f"{key}.lora_b": mx.zeros((4, 32))}, cfg)
    # the router (a Linear) is fine, an embedding is not a linear layer
    emb = "model.embed_tokens"
    _rejected(rf"'{emb}' is a Embedding, not a linear layer",
              {**tensors, f"{emb}.lora_a": mx.zeros((tiny.V, 4)), f"{emb}.lora_b": mx.zeros((4, 64))},
              {**cfg, "lora_parameters": {**cfg["lora_parameters"], "keys": None}})
    # malformed expert tensors, DoRA on experts
    _rejected(r"not an expert layer's \[experts, r, in\]",
              {**tensors, f"{key}.lora_b": tensors[f"{key}.lora_b"][:, :, :2]}, cfg)
    dora = {**tensors, f"{key}.m": mx.ones((32,))}
    _rejected(r"DoRA on expert", dora, {**cfg, "fine_tune_type": "dora"})


def test_unloading_the_last_expert_adapter_serves_the_base_model_again():
    base = build("qwen3_moe")
    tensors, cfg = _tensors()
    engine = make_engine(base, block_size=4)
    engine.load_adapter("a", config=cfg, weights=save_bytes(tensors))
    engine.unload_adapter("a")
    prompt = _prompts((9,))[0]
    res = run_all(engine, [req("b", prompt, greedy(6))])
    assert res[("b", 0)]["tokens"] == reference_greedy(build("qwen3_moe"), prompt, 6)


def _modules() -> list[str]:
    from parallm.engine.matrix import model_modules

    return [*model_modules(), "gemma4_text+moe+keqv"]


@pytest.mark.slow
@pytest.mark.parametrize("name", _modules())
def test_every_served_moe_module_takes_expert_adapters_per_row(name):
    """Every served mlx-lm module with expert (switch) layers: base + two expert LoRAs in one batch."""
    try:
        base = build(name)
    except BaseException as exc:  # noqa: BLE001 - a module that cannot be built on this machine (Metal, packages)
        pytest.skip(f"{name} cannot be built here: {exc!r}")
    if not expert_keys(base):
        pytest.skip(f"{name} has no expert layers in its tiny config")
    try:
        engine = make_engine(base, max_prefill_tokens=64, block_size=4)
    except UnsupportedModel as exc:
        pytest.skip(f"{name} is not served: {exc}")
    one, _ = adapted(name, seed=1, rank=4)
    two, _ = adapted(name, seed=2, rank=8)
    for label, model in (("one", one), ("two", two)):
        cfg = {"fine_tune_type": "lora", "num_layers": len(model.layers),
               "lora_parameters": {"rank": 4 if label == "one" else 8, "scale": 2.0, "dropout": 0.0}}
        engine.load_adapter(label, config=cfg, weights=save_bytes(adapter_tensors(model)))
    prompts = _prompts((5, 17, 30, 9))
    which = [None, "one", "two", "one"]
    models = {None: base, "one": one, "two": two}
    reqs = [req(f"r{i}", p, greedy(6), **({"adapter": w} if w else {})) for i, (w, p) in enumerate(zip(which, prompts))]
    res = run_all(engine, reqs[:2], arrivals={2: reqs[2:]})
    for i, (w, p) in enumerate(zip(which, prompts)):
        assert res[(f"r{i}", 0)]["tokens"] == reference_greedy(models[w], p, 6), f"{name}: row {i} under {w}"
