"""The model the engine serves, with what the engine must know about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True, slots=True)
class EngineModel:
    """An unmodified mlx-lm model and the facts the engine needs that the module does not carry:
    which tokens end a sequence and the context length. `vocab_size` 0 reads it from the model."""

    module: nn.Module
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 2048
    vocab_size: int = 0
    vision: Any = None  # a vision-language model's parallm.vision.encoder.VisionEncoder
    draft: nn.Module | None = None  # spec.mode draft's model (shares the vocabulary; parallm.models.draft)
    dtype_choice: Any = None  # parallm.models.dtype.DtypeChoice: stored vs served weight dtype and why


    @classmethod
    def of(cls, loaded: Any) -> "EngineModel":
        """From a parallm.models.LoadedModel."""
        return cls(loaded.model, tuple(int(t) for t in loaded.eos_token_ids), int(loaded.max_model_len),
                   int(loaded.vocab_size or 0), getattr(loaded, "vision", None),
                   dtype_choice=getattr(loaded, "dtype_choice", None))

    def resolved_vocab_size(self) -> int:
        if self.vocab_size:
            return int(self.vocab_size)
        v = getattr(getattr(self.module, "args", None), "vocab_size", None)
        if v:
            return int(v)
        return int(self.module(mx.array([[0]])).shape[-1])
