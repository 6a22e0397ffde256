"""ModelSource: an MLX model directory (mlx-lm layout) checked to hold what loading needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

# Any one of these gives transformers a tokenizer for the directory.
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("tiktoken.model",))


@dataclass(frozen=True)
class ModelSource:
    """An MLX model directory ready to load: config.json, model*.safetensors and tokenizer files."""

    path: Path
    name: str
    model_type: str


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path / 'config.json'} is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path / 'config.json'} is unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
    return config


def _missing_weights(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as exc:
            return [f"a readable {index.name} ({exc})"]
        return [shard for shard in shards if not (path / shard).is_file()]
    if any(path.glob("model*.safetensors")):
        return []
    return ["model*.safetensors (the weights)"]


def check_model_dir(path: Path, name: str) -> ModelSource:
    """A ModelSource for `path`, or a ModelLoadError naming every file that is missing there."""
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory")
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    missing += _missing_weights(path)
    if not any(all((path / f).is_file() for f in group) for group in _TOKENIZER_FILES):
        missing.append("a tokenizer (" + " or ".join("+".join(group) for group in _TOKENIZER_FILES) + ")")
    if missing:
        found = sorted(p.name for p in path.iterdir())
        hint = " (it holds .gguf files: pass one of them as the model path)" if any(
            f.endswith(".gguf") for f in found) else ""
        raise ModelLoadError(f"{path} is not an MLX model directory: missing {'; '.join(missing)}; "
                             f"found: {', '.join(found) or 'nothing'}{hint}")
    config = read_config(path)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError(f"{path / 'config.json'} has no 'model_type'")
    return ModelSource(path=path, name=name, model_type=model_type)
