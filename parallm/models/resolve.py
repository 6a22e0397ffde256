"""From a model spec (ModelConfig.path) to an MLX model directory ready to load.

Accepted specs, tried in this order:
- "default": the embedded SmolLM2-135M-Instruct GGUF, converted once into the cache;
- a path to a `.gguf` file: converted once into the cache (keyed by its name, size and mtime);
- a path to a directory: an MLX model directory (mlx-lm layout; HF safetensors layouts that
  mlx-lm loads work too), used in place;
- `org/name` or `org/name@revision`: a Hugging Face hub snapshot from the local cache only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import ModelConfig
from . import embedded
from .cache import cache_root, ensure_dir, file_key
from .errors import ModelLoadError
from .gguf_convert import convert_gguf
from .hub import fetch_snapshot, looks_like_hub_id
from .source import ModelSource, check_model_dir

log = logging.getLogger(__name__)


def converted_dir(gguf_path: Path, cache_dir: str = "") -> Path:
    """Where the conversion of `gguf_path` lives (whether or not it exists yet)."""
    return cache_root(cache_dir) / "models" / f"{gguf_path.stem}-{file_key(gguf_path)}"


def _from_gguf(path: Path, config: ModelConfig, name: str, progress: bool) -> ModelSource:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    target = converted_dir(path, config.cache_dir)
    if ensure_dir(target, lambda tmp: convert_gguf(path, tmp, progress=progress, name=name)):
        log.info("converted %s into %s", path, target)
    return check_model_dir(target, name)


def resolve_model(config: ModelConfig, *, progress: bool = True) -> ModelSource:
    """The MLX model directory for `config.path`, converting a GGUF file (once) if that is what it names.

    `progress` shows a progress bar on stderr while converting. Raises ModelLoadError with the
    reason and what was looked for when the spec cannot be served.
    """
    spec = config.path.strip()
    if not spec:
        raise ModelLoadError("no model given (model.path is empty); use 'default' for the embedded model")
    if spec == "default":
        return _from_gguf(embedded.default_gguf_path(), config, config.served_name or embedded.NAME, progress)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        return _from_gguf(path.resolve(), config, config.served_name or path.stem, progress)
    if path.is_dir():
        return check_model_dir(path.resolve(), config.served_name or path.resolve().name)
    if path.exists():
        raise ModelLoadError(f"{path} is neither a directory nor a .gguf file")
    if looks_like_hub_id(spec):
        return check_model_dir(fetch_snapshot(spec), config.served_name or spec.partition("@")[0])
    raise ModelLoadError(f"model '{spec}' not found: not 'default', not an existing directory or .gguf file, "
                         "and not a Hugging Face id of the form org/name")
