"""Speculative decoding: proposers (ngram.py), the per-row control of k (control.py), the
verification pass (verify.py) and the engine step that ties them (decoder.py)."""

from __future__ import annotations

import logging

from typing import TYPE_CHECKING

from parallm.config import EngineConfig, SpecConfig

from ..compat import ModelInfo
from .decoder import SpecDecoder

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["SpecDecoder", "spec_decoder"]

log = logging.getLogger("parallm.engine")


def spec_decoder(config: SpecConfig, settings: EngineConfig, info: ModelInfo, engine: "Engine") -> SpecDecoder | None:
    """`engine`'s speculative decoder for `config` (None with mode none, or where it cannot be exact)."""
    if config.mode == "none":
        return None
    if config.mode != "ngram":
        raise ValueError(f"spec.mode {config.mode!r} is not available (ngram or none)")
    if info.layout is not None:  # a recurrent state cannot be rolled back to the accepted position
        log.warning("spec.mode %s is off: the model keeps a recurrent state (%s)", config.mode, info.model_type)
        return None
    if settings.tensor_parallel > 1:
        log.warning("spec.mode %s is off with engine.tensor_parallel > 1", config.mode)
        return None
    return SpecDecoder(config, engine.runner, engine.scheduler, engine.output, engine.counters, engine.trace,
                       engine._launches, engine._execute)
