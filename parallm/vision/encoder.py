"""The engine's vision encoder: an mlx-vlm model's vision tower and projector (its language model
dropped), turning one request's pixel tensors into the feature rows its image tokens take."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .families import VisionFamily

__all__ = ["VisionEncoder", "image_digest"]


def image_digest(pixels: np.ndarray) -> bytes:
    """The content hash of one image's pixel values (shape included): what the prefix cache keys on."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(pixels.shape).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


class VisionEncoder:
    def __init__(self, model: Any, family: VisionFamily, config: dict, dtype: mx.Dtype) -> None:
        self.model, self.family, self.config, self.dtype = model, family, config, dtype
        self.image_token_id = family.image_token_id(config)

    def tokens(self, pixels: np.ndarray) -> int:
        """How many image tokens the prompt holds for this image."""
        return self.family.tokens(self.config, pixels.shape)

    def features(self, images: Sequence[np.ndarray]) -> mx.array:
        """[image tokens of all images, text hidden]: each image's features, in order (images of one
        shape run as one batch)."""
        rows = []
        for pixels in images:
            values = mx.array(pixels[None]).astype(self.model_dtype)
            feats = self.family.features(self.model, values)
            rows.append(feats.reshape(-1, feats.shape[-1]))
        return mx.concatenate(rows, axis=0).astype(self.dtype) if len(rows) > 1 else rows[0].astype(self.dtype)

    @property
    def model_dtype(self) -> mx.Dtype:
        for _, module in self.model.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, mx.array) and mx.issubdtype(weight.dtype, mx.floating):
                return weight.dtype
        return mx.float32
