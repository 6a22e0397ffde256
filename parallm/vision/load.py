"""A vision-language checkpoint loaded for the engine: mlx-vlm reads it (its sanitizers, its
quantization), its text model's weights move into the mlx-lm model of `text_config` (what the engine
serves, unchanged), and what is left is the vision encoder."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .encoder import VisionEncoder
from .families import VisionFamily

__all__ = ["load_vlm"]


def load_vlm(path: Path, config: dict, family: VisionFamily) -> tuple[nn.Module, VisionEncoder]:
    """(the mlx-lm text model, the vision encoder) of the checkpoint at `path`."""
    from mlx_lm.utils import _get_classes
    from mlx_vlm.utils import load_model

    vlm = load_model(path, lazy=True)
    text_config = dict(config["text_config"])
    text_config.setdefault("vocab_size", config.get("vocab_size"))
    model_class, args_class = _get_classes(text_config)
    text = model_class(args_class.from_dict(text_config))
    weights = dict(tree_flatten(getattr(vlm, family.text_prefix).parameters()))
    quant = config.get("quantization")
    if quant:
        nn.quantize(text, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    text.load_weights(list(weights.items()), strict=True)
    setattr(vlm, family.text_prefix, None)  # the encoder keeps only the vision modules
    mx.eval(text.parameters(), vlm.parameters())
    dtype = next((v.dtype for _, v in tree_flatten(text.parameters()) if mx.issubdtype(v.dtype, mx.floating)),
                 mx.float32)
    return text, VisionEncoder(vlm, family, config, dtype)
