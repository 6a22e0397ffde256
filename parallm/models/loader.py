"""Loading a resolved model: the mlx-lm model under the dtype policy, its tokenizer, and
materialized copies in a chosen dtype for baselines (mlx_lm.server, BatchGenerator)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import ModelConfig
from .cache import FORMAT_VERSION, cache_root, ensure_dir
from .dtype import DTYPES, FLOAT_DTYPES, DtypeChoice, apply_dtype, choose_dtype
from .errors import ModelLoadError
from .refused import refusal_for_type
from .resolve import resolve_model
from .source import ModelSource, read_config

log = logging.getLogger(__name__)

# Keys that state a context length, in the order they are trusted.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "n_ctx")


@dataclass
class LoadedModel:
    model: nn.Module        # an unmodified mlx-lm model instance (mlx_lm.models.<type>.Model)
    source: ModelSource
    config: dict            # the config.json contents (with generation_config's eos ids merged)
    dtype: str              # what the weights are now: float32/float16/bfloat16/quantized
    eos_token_ids: list[int]
    max_model_len: int      # min(ModelConfig.max_model_len or inf, the model's context length)
    vocab_size: int
    vision: Any = None      # a vision-language model's parallm.vision.encoder.VisionEncoder (None: text only)
    dtype_choice: DtypeChoice | None = None  # stored vs served weight dtype and why (dtype.choose_dtype)


def _text_config(config: dict) -> dict:
    return {**config.get("text_config", {}), **config}


def _check_type(source: ModelSource) -> None:
    """Refuse before loading a model type the engine is known not to serve (models/refused.py; what only
    the engine's load-time probe can tell is refused when the engine starts: parallm.engine.compat)."""
    why = refusal_for_type(source.model_type)
    if why:
        raise ModelLoadError(f"{source.path}: model_type '{source.model_type}' is not served: {why}")


def _mlx_lm_load(source: ModelSource) -> tuple[nn.Module, dict]:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    try:
        return mlx_lm_load_model(source.path, lazy=True)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"mlx-lm could not load {source.path}: {exc}") from exc


def _eos_ids(config: dict, source: ModelSource) -> list[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        raise ModelLoadError(f"{source.path} states no eos_token_id (config.json or generation_config.json); "
                             "generation could never stop on its own")
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def _context_len(config: dict, source: ModelSource, requested: int) -> int:
    merged = _text_config(config)
    own = next((int(merged[k]) for k in _CONTEXT_KEYS if isinstance(merged.get(k), int) and merged[k] > 0), None)
    if own is None and requested <= 0:
        raise ModelLoadError(f"{source.path}/config.json states no context length ({', '.join(_CONTEXT_KEYS)}); "
                             "set model.max_model_len")
    limit = min(requested if requested > 0 else math.inf, own if own is not None else math.inf)
    if own is not None and requested > own:
        log.warning("model.max_model_len %d exceeds %s's context length %d; using %d",
                    requested, source.name, own, own)
    return int(limit)


def load_model(config: ModelConfig, *, kv_budget_mb: float | None = None) -> LoadedModel:
    """Resolve `config.path`, load the mlx-lm model and apply the dtype policy (see dtype.py);
    `kv_budget_mb` is engine.kv_budget_mb (None: unset), which the policy leaves room for on a CUDA GPU."""
    source = resolve_model(config)
    _check_type(source)
    model, model_config, vision = _load_modules(source)
    choice = choose_dtype(model, config.dtype, config.quantized_weights,
                          kv_budget_bytes=None if kv_budget_mb is None else int(kv_budget_mb * (1 << 20)))
    dtype = apply_dtype(model, choice.served)
    log.info("model weights: stored %s, served %s (%s)", choice.stored, dtype, choice.reason)
    mx.eval(model.parameters())
    text = _text_config(model_config)
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int):
        raise ModelLoadError(f"{source.path}/config.json states no vocab_size")
    return LoadedModel(model=model, source=source, config=model_config, dtype=dtype,
                       eos_token_ids=_eos_ids(model_config, source),
                       max_model_len=_context_len(model_config, source, config.max_model_len),
                       vocab_size=vocab, vision=vision, dtype_choice=choice)


def _load_modules(source: ModelSource) -> tuple[nn.Module, dict, Any]:
    """(the mlx-lm model, config.json, the vision encoder or None): a vision-language family whose images are
    served (parallm/vision/families.py) is read by mlx-vlm and split into its text model and its encoder."""
    from ..vision.families import family_of

    raw = read_config(source.path)
    family = family_of(raw)
    if family is None:
        model, model_config = _mlx_lm_load(source)
        return model, model_config, None
    from ..vision.load import load_vlm

    try:
        model, vision = load_vlm(source.path, raw, family)
    except (ValueError, FileNotFoundError, KeyError, TypeError, ImportError) as exc:
        raise ModelLoadError(f"mlx-vlm could not load {source.path}: {exc}") from exc
    return model, raw, vision


def load_tokenizer(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer as a transformers PreTrainedTokenizerFast (chat_template as the model ships it);
    `trust_remote_code` lets transformers run a tokenizer class the repository ships (model.trust_remote_code)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.path), use_fast=True, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"transformers could not load the tokenizer in {source.path}: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"the tokenizer in {source.path} has no fast (tokenizers) implementation: "
                             f"{type(tokenizer).__name__}")
    return tokenizer


def _materialized_dir(source: ModelSource, dtype: str) -> Path:
    stamps = [FORMAT_VERSION, str(source.path.resolve()), dtype]
    for f in sorted(source.path.iterdir()):
        if f.is_file():
            st = f.stat()
            stamps.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\0".join(stamps).encode()).hexdigest()[:16]
    return cache_root() / "materialized" / f"{source.path.name}-{dtype}-{key}"


def _write_materialized(source: ModelSource, dtype: str, out: Path) -> None:
    model, config = _mlx_lm_load(source)
    result = apply_dtype(model, dtype)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = read_config(source.path)
    if result in FLOAT_DTYPES:
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        config["torch_dtype"] = result
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in source.path.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)


def materialize(source: ModelSource, dtype: str | None, out_dir: Path | None = None) -> Path:
    """An MLX model directory holding `source` with its weights in `dtype` (the policy of load_model).

    For mlx_lm.load / mlx_lm.server / BatchGenerator baselines that must run on exactly the weights
    parallm serves. Written atomically; by default cached under the user cache dir and reused.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)} (or leave it unset)")
    _check_type(source)
    if dtype is None:
        dtype = "float32" if mx.default_device() == mx.cpu else "stored"
    target = Path(out_dir) if out_dir is not None else _materialized_dir(source, dtype)
    requested = None if dtype == "stored" else dtype
    ensure_dir(target, lambda tmp: _write_materialized(source, requested, tmp))
    return target
