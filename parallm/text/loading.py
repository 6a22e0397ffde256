"""Loading a served model's tokenizer and context length without importing MLX."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parallm.config import ModelConfig


def model_limits(model: ModelConfig) -> dict[str, Any]:
    """max_model_len and model_type from a resolved model directory's config.json."""
    config = json.loads((Path(model.path) / "config.json").read_text())
    limit = int(config.get("max_position_embeddings") or config.get("max_seq_len") or 0)
    if model.max_model_len:
        limit = min(limit, model.max_model_len) if limit else model.max_model_len
    return {"max_model_len": limit, "model_type": config.get("model_type", ""),
            "vocab_size": int(config.get("vocab_size") or 0)}


def load_text_tokenizer(model: ModelConfig):
    """(HF fast tokenizer, limits) of a resolved model directory (the supervisor resolves `model.path`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path)
    return tokenizer, model_limits(model)
