"""Model loading: model specs -> MLX model directories -> mlx-lm models under a dtype policy.

The engine and stages use only what is exported here (see docs/models.md):

    source = resolve_model(config.model)        # "default", MLX dir, hub id (offline) or .gguf
    loaded = load_model(config.model)           # LoadedModel: mlx-lm model, dtype, eos ids, limits
    tokenizer = load_tokenizer(loaded.source)   # transformers PreTrainedTokenizerFast
    path = materialize(source, "float32")       # the same weights on disk, for baselines
    draft = load_draft(config)                  # spec.draft_model, refused unless it shares the vocabulary
"""

from .draft import load_draft
from .errors import ModelLoadError
from .loader import LoadedModel, load_model, load_tokenizer, materialize
from .resolve import resolve_model
from .source import ModelSource

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "ModelSource",
    "load_draft",
    "load_model",
    "load_tokenizer",
    "materialize",
    "resolve_model",
]
