"""The trained policy: the served base model, frozen, with mlx-lm LoRA/DoRA layers on top.

Built with mlx-lm's own `linear_to_lora_layers`, so parameter names, the adapter config and
the checkpoint files are exactly mlx-lm's: `mlx_lm.generate --adapter-path CHECKPOINT` and the
engine's adapter loader read them as they are.

The base is loaded in the precision the server serves it (the same dtype policy,
parallm.models.dtype): a quantized model stays quantized and the adapters train over its
`QuantizedLinear` layers (QLoRA, as `mlx_lm.lora` does: gradients flow to the activations
through the quantized matmul, never to the frozen packed weights), so an 8B 4-bit model costs
the trainer ~5 GB instead of a 16 GB bfloat16 copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from parallm.config import LoRATrainConfig, ModelConfig


@dataclass
class Policy:
    model: nn.Module
    adapter_config: dict[str, Any]   # mlx-lm's adapter_config.json contents
    eos_token_ids: list[int]
    max_model_len: int
    source_path: str
    dtype: str = "float32"           # what the base weights are: float32/float16/bfloat16/quantized

    def adapter_weights(self) -> dict[str, mx.array]:
        """The trainable (adapter) tensors by mlx-lm name, as published and checkpointed."""
        return dict(tree_flatten(self.model.trainable_parameters()))

    def trainable_count(self) -> int:
        return sum(v.size for v in self.adapter_weights().values())


def adapter_config(lora: LoRATrainConfig, num_layers: int) -> dict[str, Any]:
    return {"fine_tune_type": lora.fine_tune_type, "num_layers": num_layers,
            "lora_parameters": {"rank": lora.rank, "scale": lora.scale, "dropout": lora.dropout,
                                "keys": list(lora.keys)}}


def _check_keys(model: nn.Module, keys: list[str]) -> None:
    names = {name for name, _ in model.layers[0].named_modules()}
    missing = [k for k in keys if k not in names]
    if missing:
        raise ValueError(f"lora.keys {missing} name no module of a {type(model).__name__} layer; "
                         f"linear ones are: {sorted(n for n, m in model.layers[0].named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear)))}")


def load_policy(model_config: ModelConfig, lora: LoRATrainConfig, seed: int = 0) -> Policy:
    """Load the base model in `model_config.dtype` (unset: what the engine's dtype policy serves on
    this device; "quantized" keeps the stored quantization: QLoRA) and attach fresh adapters: A
    random, B zero, so version 1 equals the base."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from parallm.models import load_model

    loaded = load_model(ModelConfig(path=model_config.path, dtype=model_config.dtype,
                                    cache_dir=model_config.cache_dir, max_model_len=model_config.max_model_len))
    model = loaded.model
    layers = len(model.layers)
    num_layers = layers if lora.num_layers < 0 else min(lora.num_layers, layers)
    if lora.rank < 1:
        raise ValueError("lora.rank must be >= 1")
    _check_keys(model, list(lora.keys))
    config = adapter_config(lora, num_layers)
    mx.random.seed(seed)
    model.freeze()
    linear_to_lora_layers(model, num_layers, config["lora_parameters"], use_dora=lora.fine_tune_type == "dora")
    mx.eval(model.parameters())
    model.eval()
    return Policy(model=model, adapter_config=config, eos_token_ids=loaded.eos_token_ids,
                  max_model_len=loaded.max_model_len, source_path=str(loaded.source.path), dtype=loaded.dtype)
