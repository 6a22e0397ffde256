"""Adapters for the tests, made with mlx-lm's own LoRA layers and written in its format (or PEFT's)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from parallm.adapters import save_bytes


def lora_model(model: nn.Module, *, rank: int = 4, scale: float = 2.0, keys=("self_attn.q_proj", "self_attn.v_proj"),
               num_layers: int = -1, dora: bool = False, seed: int = 1, spread: float = 0.3) -> dict:
    """Turn `model` (a fresh copy) into an mlx-lm LoRA model with random non-zero adapter weights.
    Returns the mlx-lm adapter_config.json contents."""
    mx.random.seed(seed)
    model.freeze()
    n = len(model.layers) if num_layers < 0 else num_layers
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    linear_to_lora_layers(model, n, params, use_dora=dora)
    new = []
    for k, v in tree_flatten(model.trainable_parameters()):
        if k.endswith(".m"):
            new.append((k, v * (1.0 + 0.2 * mx.random.uniform(shape=v.shape))))
        else:
            new.append((k, mx.random.normal(v.shape) * spread))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return {"fine_tune_type": "dora" if dora else "lora", "num_layers": n, "lora_parameters": params}


def adapter_tensors(model: nn.Module) -> dict[str, mx.array]:
    """What mlx_lm's trainer saves: the trainable parameters (lora_a, lora_b, m)."""
    return dict(tree_flatten(model.trainable_parameters()))


def save_mlx(model: nn.Module, config: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), adapter_tensors(model))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def to_peft(tensors: dict[str, mx.array], config: dict) -> tuple[dict, bytes]:
    """The same adapter in PEFT's layout: lora_A [r, in], lora_B [out, r], lora_alpha = scale * r."""
    lp = config["lora_parameters"]
    out = {}
    for k, v in tensors.items():
        module, leaf = k.rsplit(".", 1)
        name = {"lora_a": "lora_A", "lora_b": "lora_B"}[leaf]
        out[f"base_model.model.{module}.{name}.weight"] = v.T
    targets = sorted({k.rsplit(".", 2)[-2] for k in tensors})
    cfg = {"peft_type": "LORA", "r": lp["rank"], "lora_alpha": lp["scale"] * lp["rank"], "target_modules": targets,
           "bias": "none", "lora_dropout": 0.0, "base_model_name_or_path": "test"}
    return cfg, save_bytes(out)
