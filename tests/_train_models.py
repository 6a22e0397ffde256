"""Tiny random-weight model directories for the trainer's tests: a llama of the default model's
vocabulary (so its tokenizer files fit), stored 4-bit quantized like mlx-community's quants."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

CONFIG = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=49152, rope_theta=10000.0,
              tie_word_embeddings=True, max_position_embeddings=512, eos_token_id=2, bos_token_id=1)


def quantized_model_dir(out: Path, *, bits: int = 4, group_size: int = 32, seed: int = 0) -> Path:
    """An MLX model directory of a tiny llama quantized to `bits` (bits 0: float32), with the default
    model's tokenizer."""
    from mlx_lm.models import llama

    from parallm.config import ModelConfig
    from parallm.models import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
        config["quantization"] = {"group_size": group_size, "bits": bits}
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    source = resolve_model(ModelConfig()).path
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(source / name, out / name)
    return out
