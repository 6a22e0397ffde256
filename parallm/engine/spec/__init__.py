"""Speculative decoding: proposers (ngram.py; draft.py with its KV rows, draft_kv.py), the per-row
control of k (control.py), the verification passes (verify.py; draft_verify.py) and the engine step
that ties them (decoder.py)."""

from __future__ import annotations

import logging

from typing import TYPE_CHECKING

from parallm.config import EngineConfig, SpecConfig

from ..compat import ModelInfo, check_model
from ..fastmath import FastMath, stand_ins
from .decoder import SpecDecoder
from .draft import DraftProposer

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["SpecDecoder", "spec_decoder"]

log = logging.getLogger("parallm.engine")


def spec_decoder(config: SpecConfig, settings: EngineConfig, info: ModelInfo, engine: "Engine") -> SpecDecoder | None:
    """`engine`'s speculative decoder for `config` (None with mode none, or where it cannot be exact)."""
    if config.mode == "none":
        return None
    if config.mode not in ("ngram", "draft"):
        raise ValueError(f"spec.mode {config.mode!r} is not one of none, ngram, draft")
    if info.layout is not None:  # a recurrent state cannot be rolled back to the accepted position
        log.warning("spec.mode %s is off: the model keeps a recurrent state (%s)", config.mode, info.model_type)
        return None
    if settings.tensor_parallel > 1:
        log.warning("spec.mode %s is off with engine.tensor_parallel > 1", config.mode)
        return None
    draft = draft_proposer(engine, config.draft_acceptance == "coupled") if config.mode == "draft" else None
    return SpecDecoder(config, engine.runner, engine.scheduler, engine.output, engine.counters, engine.trace,
                       engine._launches, engine._execute, draft)


def draft_proposer(engine: "Engine", coupled: bool = True) -> DraftProposer:
    """The proposer over the engine's draft model (EngineModel.draft), coupled to the target's sampling noise or
    not (spec.draft_acceptance); a ValueError names why there is none."""
    model = engine.draft_model
    if model is None:
        raise ValueError("spec.mode draft needs a draft model (spec.draft_model)")
    info = check_model(model)
    if info.layout is not None:
        raise ValueError(f"the draft model ({info.model_type}) keeps a recurrent state, which cannot be rolled "
                         "back to the accepted position: pick an attention-only draft")
    return DraftProposer(model, info, engine.vocab_size, engine.eos_token_ids, compiled=engine.config.compile,
                         coupled=coupled, context=draft_context(model, engine.config))


def draft_context(model, settings: EngineConfig) -> FastMath | None:
    """What the draft's passes run under: the stand-ins the runner gives the target's passes (fast math on the
    CPU; on CUDA attention as matmuls for a masked one-token pass and for short multi-token ones, where mlx-lm's
    call composes a masked decode or builds a cuDNN graph for every new shape: a draft pass's key span grows
    every cycle). None where they replace nothing."""
    context = stand_ins(model, fast_math=bool(settings.fast_math), unfused_keys=settings.unfused_prefill_keys or 0,
                        unfused_decode=bool(settings.unfused_decode))
    return context if settings.fast_math or context.active else None
