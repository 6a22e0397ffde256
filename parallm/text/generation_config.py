"""A model's sampling defaults from its generation_config.json, as vLLM's `--generation-config`.

`model.generation_config` (`--generation-config`): unset (`auto`) reads the served model
directory's generation_config.json, `none` uses none, anything else is a directory holding one. Of the file
only vLLM's keys count: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens
as the default max_tokens (do_sample and the rest are ignored, as vLLM does). The OpenAI routes
apply them to a request that omits the field (parallm.api.translate.sampling_params); a request's
own value always wins. Read without importing MLX (the ingress stage reads it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from parallm.config import ModelConfig

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field, and the values it may hold
_FLOATS = {"temperature": (0.0, math.inf), "top_p": (1e-9, 1.0), "min_p": (0.0, 1.0),
           "repetition_penalty": (1e-9, math.inf)}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = field(default_factory=dict)  # SamplingParams field -> default
    max_tokens: int | None = None  # max_new_tokens: max_tokens for a request that gives none
    source: str = ""  # the file read ("" when none)


def generation_defaults(model: ModelConfig) -> GenerationDefaults:
    """The defaults `model.generation_config` names for the model at `model.path` (a resolved directory).
    A file that holds a bad value, or a DIR without the file, is a ValueError naming it."""
    setting = model.generation_config
    if setting == "none":
        return GenerationDefaults()
    path = Path(model.path if setting is None else setting).expanduser() / FILE
    if not path.is_file():
        if setting is None:
            return GenerationDefaults()
        raise ValueError(f"model.generation_config: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return parse_generation_config(data, str(path))


def _number(data: dict, key: str, where: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number (got {value!r})")
    return value


def parse_generation_config(data: dict, where: str = FILE) -> GenerationDefaults:
    """The sampling defaults of a generation_config.json's contents (keys set to null count as absent)."""
    sampling: dict[str, float | int] = {}
    for key, (low, high) in _FLOATS.items():
        if data.get(key) is not None:
            value = float(_number(data, key, where))
            if not low <= value <= high:
                raise ValueError(f"{where}: {key} {value} is outside [{low:g}, {high:g}]")
            sampling[key] = value
    if data.get("top_k") is not None:
        top_k = _number(data, "top_k", where)
        if top_k != int(top_k):
            raise ValueError(f"{where}: top_k must be an integer (got {top_k!r})")
        sampling["top_k"] = max(0, int(top_k))  # 0 and -1 both mean "off" (vLLM: -1, here: 0)
    max_tokens = None
    if data.get("max_new_tokens") is not None:
        value = _number(data, "max_new_tokens", where)
        if value != int(value) or value < 1:
            raise ValueError(f"{where}: max_new_tokens must be a positive integer (got {value!r})")
        max_tokens = int(value)
    return GenerationDefaults(sampling=sampling, max_tokens=max_tokens, source=where if sampling or max_tokens else "")
