"""Tiny random-weight decoder pooling models written as model directories: a Llama backbone
(tiny.fill's sizes) with the default model's tokenizer (SmolLM2's, chat template included), as an
embedding model, a `LlamaForSequenceClassification` reward model (one label) or a classifier."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from parallm.config import ModelConfig
from parallm.models.resolve import resolve_model
from parallm.models.tiny import _finish, fill

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_decoder(path: Path, kind: str = "reward", seed: int = 0, labels: int = 1,
                  extra: dict | None = None) -> tuple[Path, llama.Model, mx.array | None]:
    """(directory, the model, score weight or None). kind: 'embed' | 'seqcls'."""
    default = resolve_model(ModelConfig(path="default"), progress=False).path
    vocab = json.loads((default / "config.json").read_text())["vocab_size"]
    cfg = {**fill("llama"), "model_type": "llama", "vocab_size": vocab, "eos_token_id": 2,
           "tie_word_embeddings": True, **(extra or {})}
    mx.random.seed(seed)
    model = _finish(llama.Model(llama.ModelArgs.from_dict(cfg)), seed, 1.0)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("lm_head")}
    score = None
    if kind == "seqcls":
        score = mx.random.normal((labels, cfg["hidden_size"])) * 0.5
        weights["score.weight"] = score
        cfg["architectures"] = ["LlamaForSequenceClassification"]
        cfg["num_labels"] = labels
        if labels > 1:
            cfg["id2label"] = {str(i): f"class_{i}" for i in range(labels)}
    else:
        cfg["architectures"] = ["LlamaModel"]
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(cfg))
    for name in TOKENIZER_FILES:
        if (default / name).is_file():
            shutil.copy(default / name, path / name)
    return path, model, score


def direct(model: llama.Model, ids: list[int], how: str = "last") -> mx.array:
    """The backbone's hidden states of one unpadded sequence, pooled: the reference for a served value."""
    hidden = model.model(mx.array([ids]))[0].astype(mx.float32)
    return hidden[-1] if how == "last" else hidden.mean(axis=0)
