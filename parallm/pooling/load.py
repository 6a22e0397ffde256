"""From a pooling model spec to a PoolingModel: the embedded all-MiniLM-L6-v2, a sentence-transformers
or Hugging Face encoder directory (BERT, RoBERTa, XLM-R), a decoder LM that mlx-lm loads (used as an
embedding model with last-token or mean pooling), or a decoder `*ForSequenceClassification` model
(its `score.weight` head gives a reward, or class logits).

Specs: "default" (the embedded model, unzipped and converted once into the model cache), a model
directory, or a hub id in the local cache. The task is read from the config (spec.describe) unless
one is given.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import mlx.core as mx

from ..config import ModelConfig
from ..config.pooling import parse_entry
from ..models import embedded
from ..models.cache import cache_root, ensure_dir, file_key
from ..models.errors import ModelLoadError
from ..models.hub import fetch_snapshot, looks_like_hub_id
from ..models.loader import load_tokenizer
from ..models.source import check_model_dir, read_config
from .bert import BertArgs, BertEncoder
from .model import PoolingModel
from .spec import PoolingInfo, PoolingModelError, describe, pooling_task

log = logging.getLogger(__name__)


def _convert_zip(zip_path: Path, out: Path) -> None:
    """Unzip a sentence-transformers directory and write its weights as MLX float32 safetensors."""
    with zipfile.ZipFile(zip_path) as zf:
        for member in zf.namelist():
            if not str((out / member).resolve()).startswith(str(out.resolve())):
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


def resolve_served_model(model: ModelConfig, cache_dir: str = "") -> tuple[str, str] | None:
    """(the 'NAME:TASK=DIR' entry, its task) when model.path is served as a pooling model with no generator:
    model.task a pooling task (then 'default' is the embedded all-MiniLM-L6-v2), or unset (auto) and model.path a
    directory (or hub id) that pooling_task recognises; None: a generator (resolve_model's business)."""
    spec, task = model.path.strip(), model.task
    if task == "generate" or (task is None and (spec == "default" or spec.lower().endswith(".gguf"))):
        return None
    if task is None:
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path.resolve()
        elif looks_like_hub_id(spec) and not path.exists():
            path = fetch_snapshot(spec)
        else:
            return None  # not a directory: resolve_model says what it is not
        try:
            found = pooling_task(path)
        except PoolingModelError as exc:
            raise ModelLoadError(str(exc)) from None
        if found is None:
            return None
        spec, task = str(path), found
    path, default_name = resolve_pooling_dir(spec, cache_dir)
    name = model.served_name or default_name
    info = _describe(path, name, task)
    return f"{name}:{info.task}={path}", info.task


def resolve_entries(entries: list[str], cache_dir: str = "") -> list[str]:
    """model.pooling entries with every path resolved (converted once) and every task stated:
    'NAME:TASK=DIR', what the supervisor hands the stages."""
    out = []
    for entry in entries:
        name, task, spec = parse_entry(entry)
        path, _ = resolve_pooling_dir(spec, cache_dir)
        out.append(f"{name}:{_describe(path, name, task).task}={path}")
    return out


def _describe(path: Path, name: str, task: str, max_len: int = 0) -> PoolingInfo:
    try:
        return describe(path, name, task, max_len)
    except PoolingModelError as exc:
        raise ModelLoadError(str(exc)) from None


def _load_tensors(path: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _encoder(path: Path, info: PoolingInfo) -> PoolingModel:
    net = BertEncoder(BertArgs.from_config(read_config(path)))
    net.load_weights(list(BertEncoder.sanitize(_load_tensors(path)).items()), strict=True)
    mx.eval(net.parameters())
    return PoolingModel(info, net, load_tokenizer(check_model_dir(path, info.name)), net)


def _decoder(path: Path, info: PoolingInfo) -> PoolingModel:
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path, lazy=True, strict=False)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"mlx-lm could not load {path}: {exc}") from exc
    backbone_module = getattr(model, "model", None)
    if backbone_module is None:
        raise ModelLoadError(f"{path}: the mlx-lm model has no .model backbone to pool")
    head = None
    if info.task in ("reward", "classify"):
        head = _load_tensors(path).get("score.weight")
        if head is None:
            raise ModelLoadError(f"{path}: task '{info.task}' needs a sequence-classification head (score.weight)")
        if head.shape[0] != info.dims:
            raise ModelLoadError(f"{path}: score.weight has {head.shape[0]} rows; the config states {info.dims} labels")
        mx.eval(head)
    if hasattr(model, "lm_head"):
        model.lm_head = None  # pooling never reads the vocabulary head
    mx.eval(backbone_module.parameters())

    def backbone(ids: mx.array, lengths: mx.array) -> mx.array:
        return backbone_module(ids)  # causal: right padding never reaches a valid position

    return PoolingModel(info, backbone, load_tokenizer(check_model_dir(path, info.name)), backbone_module, head=head)


def load_pooling_model(spec: str, *, name: str = "", task: str = "", cache_dir: str = "",
                       max_len: int = 0) -> PoolingModel:
    """Load the pooling model `spec` names, served as `name`, for `task` (or the config's)."""
    path, default_name = resolve_pooling_dir(spec, cache_dir)
    info = _describe(path, name or default_name, task, max_len)
    model = _encoder(path, info) if info.family == "encoder" else _decoder(path, info)
    log.info("pooling model %s (%s, %s %s pooling, %d dims) from %s", info.name, info.task, info.family,
             info.pooling, info.dims, path)
    return model


def load_entry(entry: str, cache_dir: str = "") -> PoolingModel:
    """A model.pooling entry ('NAME[:TASK]=PATH') loaded."""
    name, task, spec = parse_entry(entry)
    return load_pooling_model(spec, name=name, task=task, cache_dir=cache_dir)
