"""The embedded default model (SmolLM2-135M-Instruct), loaded through parallm.models once per process."""

from __future__ import annotations

import functools

import mlx.nn as nn

from parallm.config import ModelConfig
from parallm.models import load_model

EOS_TOKEN_ID = 2  # <|im_end|>
BOS_TOKEN_ID = 1
VOCAB_SIZE = 49152


@functools.lru_cache(maxsize=2)
def default_model(dtype_name: str = "float32") -> nn.Module:
    loaded = load_model(ModelConfig(dtype=dtype_name))
    assert loaded.eos_token_ids[0] == EOS_TOKEN_ID and loaded.vocab_size == VOCAB_SIZE
    return loaded.model
