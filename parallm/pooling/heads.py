"""Pooling of hidden states into one vector per sequence, and what is done with that vector.

Sequences arrive right-padded in a batch [B, N, H] with their lengths [B]. Mean pooling averages
the valid positions; `cls` takes position 0; `last` takes each row's last valid position (what
decoder embedding models such as Qwen3-Embedding and `*ForSequenceClassification` heads use).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

POOLINGS = ("mean", "cls", "last")


def pool(hidden: mx.array, lengths: mx.array, how: str) -> mx.array:
    """[B, N, H] hidden states, [B] lengths -> [B, H] float32."""
    hidden = hidden.astype(mx.float32)
    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        return mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if how == "mean":
        valid = (mx.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(mx.float32)
        return (hidden * valid[..., None]).sum(axis=1) / mx.maximum(valid.sum(axis=1, keepdims=True), 1.0)
    raise ValueError(f"unknown pooling '{how}' (one of {', '.join(POOLINGS)})")


def l2_normalize(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def truncate_dims(vectors: np.ndarray, dims: int) -> np.ndarray:
    """Matryoshka truncation: the first `dims` components, renormalized to unit length."""
    cut = vectors[:, :dims].astype(np.float32)
    return cut / np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), 1e-12)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)
