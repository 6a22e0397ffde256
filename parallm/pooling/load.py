"""From a pooling model spec to a PoolingModel: the embedded all-MiniLM-L6-v2, a sentence-transformers
or Hugging Face encoder directory (BERT, RoBERTa, XLM-R), a decoder LM that mlx-lm loads (used as an
embedding model with last-token or mean pooling), or a decoder `*ForSequenceClassification` model
(its `score.weight` head gives a reward, or class logits).

Specs: "default" (the embedded model, unzipped and converted once into the model cache), a model
directory, or a hub id in the local cache. The task is read from the config (a sequence-classification
architecture with one label is a reward model, with several a classifier; anything else embeds)
unless one is given.
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..models import embedded
from ..models.cache import cache_root, ensure_dir, file_key
from ..models.errors import ModelLoadError
from ..models.hub import fetch_snapshot, looks_like_hub_id
from ..models.loader import load_tokenizer
from ..models.source import check_model_dir, read_config
from .bert import ENCODER_TYPES, BertArgs, BertEncoder
from .heads import POOLINGS
from .model import TASKS, PoolingInfo, PoolingModel

log = logging.getLogger(__name__)


def _convert_zip(zip_path: Path, out: Path) -> None:
    """Unzip a sentence-transformers directory and write its weights as MLX float32 safetensors."""
    with zipfile.ZipFile(zip_path) as zf:
        for member in zf.namelist():
            target = (out / member).resolve()
            if not str(target).startswith(str(out.resolve())):
                raise ModelLoadError(f"{zip_path}: member {member} points outside the archive")
        zf.extractall(out)
    for weights in out.glob("model*.safetensors"):
        tensors = BertEncoder.sanitize(mx.load(str(weights)))
        mx.save_safetensors(str(weights), {k: v.astype(mx.float32) for k, v in tensors.items()},
                            metadata={"format": "mlx"})


def resolve_pooling_dir(spec: str, cache_dir: str = "") -> tuple[Path, str]:
    """(model directory, default served name) for a pooling model spec."""
    spec = spec.strip()
    if spec == "default":
        zip_path = embedded.default_embedding_zip()
        target = cache_root(cache_dir) / "models" / f"{embedded.EMBED_NAME}-{file_key(zip_path)}"
        if ensure_dir(target, lambda tmp: _convert_zip(zip_path, tmp)):
            log.info("converted %s into %s", zip_path, target)
        return target, embedded.EMBED_NAME
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve(), path.resolve().name
    if looks_like_hub_id(spec):
        return fetch_snapshot(spec), spec.partition("@")[0]
    raise ModelLoadError(f"pooling model '{spec}' not found: not 'default', not a directory, "
                         "not a Hugging Face id of the form org/name")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is unreadable: {exc}") from None


def _st_pooling(path: Path) -> tuple[str | None, bool]:
    """(pooling, normalize) from a sentence-transformers directory's modules, if it is one."""
    modules = _read_json(path / "modules.json") or []
    how, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            cfg = _read_json(path / module.get("path", "") / "config.json") or {}
            modes = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                     "pooling_mode_lasttoken": "last"}
            picked = [mode for key, mode in modes.items() if cfg.get(key)]
            if len(picked) != 1 or any(cfg.get(k) for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")):
                raise ModelLoadError(f"{path}: pooling {cfg} is not supported (one of mean, cls, last tokens)")
            how = picked[0]
        elif kind.endswith(".Normalize"):
            normalize = True
    return how, normalize


def _task_of(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return "reward" if _num_labels(config) == 1 else "classify"
    return "embed"


def _num_labels(config: dict[str, Any]) -> int:
    if isinstance(config.get("id2label"), dict) and config["id2label"]:
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def _labels(config: dict[str, Any], n: int) -> tuple[str, ...]:
    id2label = config.get("id2label") or {}
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


def _load_tensors(path: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _encoder(path: Path, config: dict[str, Any], name: str, task: str) -> PoolingModel:
    if task != "embed":
        raise ModelLoadError(f"{path}: encoder models are served for task 'embed' only, not '{task}'")
    args = BertArgs.from_config(config)
    net = BertEncoder(args)
    net.load_weights(list(BertEncoder.sanitize(_load_tensors(path)).items()), strict=True)
    mx.eval(net.parameters())
    how, normalize = _st_pooling(path)
    st = _read_json(path / "sentence_bert_config.json") or {}
    max_len = int(st.get("max_seq_length", args.max_position_embeddings - args.position_offset))
    info = PoolingInfo(name=name, task="embed", family="encoder", pooling=how or "cls", normalize=normalize,
                       dims=args.hidden_size, max_len=max_len, matryoshka=_matryoshka(config))
    return PoolingModel(info, net, load_tokenizer(check_model_dir(path, name)), net)


def _decoder(path: Path, config: dict[str, Any], name: str, task: str, max_len: int) -> PoolingModel:
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path, lazy=True, strict=False)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from exc
    backbone_module = getattr(model, "model", None)
    if backbone_module is None:
        raise ModelLoadError(f"{path}: the mlx-lm model has no .model backbone to pool")
    head = None
    if task in ("reward", "classify"):
        tensors = _load_tensors(path)
        head = tensors.get("score.weight")
        if head is None:
            raise ModelLoadError(f"{path}: task '{task}' needs a sequence-classification head (score.weight)")
        mx.eval(head)
    if hasattr(model, "lm_head"):
        model.lm_head = None  # pooling never reads the vocabulary head
    mx.eval(backbone_module.parameters())
    how, normalize = _st_pooling(path)
    dims = int(head.shape[0]) if head is not None else int(config.get("hidden_size") or config["text_config"]["hidden_size"])
    own_len = int(config.get("max_position_embeddings") or 32768)
    info = PoolingInfo(name=name, task=task, family="decoder", pooling=how or "last",
                       normalize=(normalize or how is None) and task == "embed", dims=dims,
                       max_len=min(own_len, max_len) if max_len > 0 else own_len,
                       labels=_labels(config, dims) if task == "classify" else (),
                       matryoshka=_matryoshka(config) if task == "embed" else None)

    def backbone(ids: mx.array, lengths: mx.array) -> mx.array:
        return backbone_module(ids)  # causal: right padding never reaches a valid position

    tokenizer = load_tokenizer(check_model_dir(path, name))
    return PoolingModel(info, backbone, tokenizer, backbone_module, head=head,
                        chat_template=bool(getattr(tokenizer, "chat_template", None)))


def load_pooling_model(spec: str, *, name: str = "", task: str = "", cache_dir: str = "",
                       max_len: int = 0) -> PoolingModel:
    """Load the pooling model `spec` names, served as `name`, for `task` (or the config's)."""
    path, default_name = resolve_pooling_dir(spec, cache_dir)
    config = read_config(path)
    task = task or _task_of(config)
    if task not in TASKS:
        raise ModelLoadError(f"unknown pooling task '{task}' (one of {', '.join(TASKS)})")
    model_type = str(config.get("model_type", ""))
    if model_type in ENCODER_TYPES:
        model = _encoder(path, config, name or default_name, task)
    else:
        model = _decoder(path, config, name or default_name, task, max_len)
    if model.info.pooling not in POOLINGS:
        raise ModelLoadError(f"{path}: unknown pooling '{model.info.pooling}'")
    log.info("pooling model %s (%s, %s %s pooling, %d dims) from %s", model.info.name, model.info.task,
             model.info.family, model.info.pooling, model.info.dims, path)
    return model
