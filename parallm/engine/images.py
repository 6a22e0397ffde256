"""A request's images in the engine: where their features go in the prompt, what the prefix cache keys
their tokens by, and the input embeddings of a prefill pass that covers some of them.

The prompt holds one run of the model's image token per image, as long as the image's features
(parallm/vision/families.py). For the prefix cache those positions stand for the image's content, not
the placeholder id: each becomes a negative pseudo id drawn from the image's digest and the position
within the image (SGLang pads image tokens with hash values the same way), so the chained block hashes
and their collision checks separate two images under the same text and reuse blocks for the same image.
Features are computed when a prefill chunk first reaches an image token that the cache did not hold,
and dropped once the prompt is past its last image."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import mlx.core as mx
import numpy as np

from .request import RequestRejected

__all__ = ["SeqImages", "attach_images", "prefill_embeddings", "unpack_images"]

_PSEUDO_SPAN = 2**31 - 2


@dataclass(slots=True)
class SeqImages:
    pixels: list[np.ndarray]
    positions: np.ndarray          # the prompt positions of the image tokens, all images, in order
    pseudo: np.ndarray             # their prefix-cache ids (negative, from the images' digests)
    features: mx.array | None = None  # [len(positions), hidden] while the prompt is being prefilled
    computed: int = field(default=0)  # times the features were computed (a preempted row recomputes)

    def cache_ids(self, token_ids: list[int]) -> list[int]:
        ids = list(token_ids)
        for pos, value in zip(self.positions.tolist(), self.pseudo.tolist()):
            ids[pos] = value
        return ids


def unpack_images(tensors: Seq[Any]) -> list[np.ndarray]:
    """A Submit's image tensors as arrays; RequestRejected naming the first one whose bytes do not fit."""
    from ..protocol import unpack_tensor

    out = []
    for i, t in enumerate(tensors):
        try:
            out.append(unpack_tensor(t).astype(np.float32))
        except ValueError as exc:
            raise RequestRejected(f"images[{i}]: {exc}", f"images[{i}]") from None
    return out


def attach_images(prompt_ids: list[int], images: Seq[np.ndarray], encoder: Any) -> SeqImages | None:
    """The images of a request, checked against its prompt's image-token runs; None without images.
    RequestRejected when the model takes no images or the runs do not fit the images."""
    ids = np.asarray(prompt_ids)
    token = -1 if encoder is None else encoder.image_token_id
    positions = np.flatnonzero(ids == token)
    if not images:
        if len(positions):
            raise RequestRejected(f"the prompt holds {len(positions)} image tokens (id {token}) but no images",
                                  "prompt")
        return None
    if encoder is None:
        raise RequestRejected("this model takes text only; images cannot be sent to it", "images")
    from ..vision.encoder import image_digest

    pseudo, runs, at = [], [], 0
    for i, pixels in enumerate(images):
        if pixels.ndim != 3 or not np.issubdtype(pixels.dtype, np.floating) or not np.isfinite(pixels).all():
            raise RequestRejected(f"images[{i}] must be finite float pixel values of shape [channels, height, "
                                  "width]", f"images[{i}]")
        try:
            n = encoder.tokens(pixels)
        except (ValueError, KeyError, IndexError) as exc:
            raise RequestRejected(f"images[{i}]: {exc}", f"images[{i}]") from None
        digest = int.from_bytes(image_digest(pixels)[:8], "little")
        pseudo.extend(-1 - ((digest + k) % _PSEUDO_SPAN) for k in range(n))
        runs.append(n)
        at += n
    if at != len(positions):
        raise RequestRejected(f"the prompt holds {len(positions)} image tokens (id {token}); its "
                              f"{len(images)} images take {'+'.join(map(str, runs))} = {at}", "images")
    return SeqImages(list(images), positions, np.asarray(pseudo, dtype=np.int64))


def prefill_embeddings(model: Any, encoder: Any, seqs: Seq[Any], starts: Seq[int], lengths: Seq[int],
                       tokens: mx.array) -> mx.array | None:
    """The input embeddings of a padded prefill pass (`tokens` [rows, L]) with every image token it covers
    replaced by its feature row; None when the pass covers no image token."""
    rows, cols, feats = [], [], []
    for i, (seq, start, n) in enumerate(zip(seqs, starts, lengths)):
        images = seq.images
        if images is None or not n:
            continue
        pos = images.positions
        hit = np.flatnonzero((pos >= start) & (pos < start + n))
        if not len(hit):
            continue
        if images.features is None:
            images.features = encoder.features(images.pixels)
            images.computed += 1
        rows.extend([i] * len(hit))
        cols.extend((pos[hit] - start).tolist())
        feats.append(images.features[mx.array(hit, dtype=mx.int32)])
        if start + n > int(pos[-1]):
            images.features = None  # the prompt is past its last image
    if not rows:
        return None
    embed = model.model.embed_tokens
    h = embed(tokens)
    h[mx.array(rows, dtype=mx.int32), mx.array(cols, dtype=mx.int32)] = mx.concatenate(feats).astype(h.dtype)
    return h
