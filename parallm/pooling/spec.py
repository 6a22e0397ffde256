"""What a pooling model is, read from its directory without loading it (no MLX here: ingress and the
tokenizer stage use it too). The `NAME[:TASK]=PATH` spelling of `model.pooling` entries is
parallm/config/pooling.py's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.pooling import TASKS


class PoolingModelError(ValueError):
    """A pooling model directory that cannot be served as asked (load.py raises it as a ModelLoadError)."""

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")


@dataclass(frozen=True)
class PoolingInfo:
    """What a served pooling model is: the server reports it and validates requests against it."""

    name: str
    task: str                         # embed | reward | classify
    family: str                       # encoder | decoder
    pooling: str                      # mean | cls | last
    normalize: bool                   # unit-length embeddings (embed only)
    dims: int                         # embedding width, or the number of labels
    max_len: int                      # longest input in tokens
    vocab_size: int = 0               # token ids must be below it
    labels: tuple[str, ...] = ()      # classify: label of each output index
    matryoshka: tuple[int, ...] | None = None  # embed: allowed `dimensions` (() = any width up to dims)

    def allows_dimensions(self, dims: int) -> bool:
        if self.matryoshka is None:
            return False
        return 0 < dims <= self.dims and (not self.matryoshka or dims in self.matryoshka)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError) as exc:
        raise PoolingModelError(f"{path} is unreadable: {exc}") from None


def st_pooling(path: Path) -> tuple[str | None, bool]:
    """(pooling, normalize) from a sentence-transformers directory's modules.json, if it is one."""
    modules = _read_json(path / "modules.json") or []
    how, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            cfg = _read_json(path / module.get("path", "") / "config.json") or {}
            modes = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                     "pooling_mode_lasttoken": "last"}
            picked = [mode for key, mode in modes.items() if cfg.get(key)]
            if len(picked) != 1 or any(cfg.get(k) for k in ("pooling_mode_max_tokens",
                                                             "pooling_mode_mean_sqrt_len_tokens")):
                raise PoolingModelError(f"{path}: pooling {cfg} is not supported (one of mean, cls, last tokens)")
            how = picked[0]
        elif kind.endswith(".Normalize"):
            normalize = True
    return how, normalize


def task_of(config: dict[str, Any]) -> str:
    """The task a config states: a sequence-classification head with one label rewards, with more classifies."""
    archs = config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return "reward" if num_labels(config) == 1 else "classify"
    return "embed"


def pooling_task(path: Path) -> str | None:
    """The task of a model directory that is a pooling model (an encoder, a `*ForSequenceClassification`
    head, a sentence-transformers directory with a Pooling module), or None: a generator (model.task auto)."""
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        return None
    text = {**config.get("text_config", {}), **config}
    archs = [str(a) for a in config.get("architectures") or []]
    if text.get("model_type") in ENCODER_TYPES or any(a.endswith("ForSequenceClassification") for a in archs):
        return task_of(config)
    return "embed" if st_pooling(path)[0] else None


def num_labels(config: dict[str, Any]) -> int:
    if isinstance(config.get("id2label"), dict) and config["id2label"]:
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def _labels(config: dict[str, Any], n: int) -> tuple[str, ...]:
    id2label = config.get("id2label") or {}
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(n))


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    """config.json's `matryoshka_dimensions` (the widths it was trained for) or `is_matryoshka` (any)."""
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


def describe(path: Path, name: str, task: str = "", max_len: int = 0) -> PoolingInfo:
    """The PoolingInfo of the model directory `path` served as `name` for `task` ('' = its config's)."""
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise PoolingModelError(f"{path / 'config.json'} is missing or not a JSON object")
    task = task or task_of(config)
    if task not in TASKS:
        raise PoolingModelError(f"unknown pooling task '{task}' (one of {', '.join(TASKS)})")
    text = {**config.get("text_config", {}), **config}
    how, normalize = st_pooling(path)
    own_len = int(text.get("max_position_embeddings") or 0)
    if text.get("model_type") in ENCODER_TYPES:
        if task != "embed":
            raise PoolingModelError(f"{path}: encoder models are served for task 'embed' only, not '{task}'")
        if text.get("model_type") != "bert":
            own_len -= int(text.get("pad_token_id", 1)) + 1  # RoBERTa's positions start after the pad id
        st = _read_json(path / "sentence_bert_config.json") or {}
        own_len = int(st.get("max_seq_length", own_len))
        family, how, normalize = "encoder", how or "cls", normalize
    else:
        family, how = "decoder", how or "last"
        normalize = task == "embed" and (normalize or not (path / "modules.json").is_file())
    own_len = own_len or 32768
    dims = int(text["hidden_size"]) if task == "embed" else (1 if task == "reward" else num_labels(config))
    return PoolingInfo(name=name, task=task, family=family, pooling=how, normalize=normalize, dims=dims,
                       max_len=min(own_len, max_len) if max_len > 0 else own_len,
                       vocab_size=int(text.get("vocab_size") or 0),
                       labels=_labels(config, dims) if task == "classify" else (),
                       matryoshka=_matryoshka(config) if task == "embed" else None)
