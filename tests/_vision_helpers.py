"""The vision tests' helpers: the tiny checkpoints (parallm/models/tiny_vlm.py, shared with perf/bench_vision)
and mlx-vlm's own greedy generation as the reference."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from parallm.models.tiny_vlm import (FAMILIES, IMAGE_SIZE, IMAGE_TOKEN, PATCH, PIXTRAL_EDGE, PIXTRAL_TOKENS,  # noqa: F401
                                 data_url, png, write_vlm)


def reference_tokens(path: Path, prompt_ids: list[int], pixels: list[np.ndarray], max_tokens: int) -> list[int]:
    """mlx-vlm's own greedy generation (its model class, weights loader and generate_step) for the prompt
    ids (one run of image tokens per image) and the images' pixel values (one [C, H, W] array each).
    mlx-vlm 0.7.10's LlavaProcessor cannot run under transformers 5.24 (it passes `padding` to the
    PIL image processor, which refuses it), so the prompt is processed by the caller, as parallm does."""
    from mlx_vlm import load
    from mlx_vlm.generate import generate_step

    model, _ = load(str(path))
    values = mx.array(np.stack(pixels)) if pixels else None
    out = []
    for token, _ in generate_step(mx.array([prompt_ids]), model, values, None, max_tokens=max_tokens,
                                  temperature=0.0):
        out.append(int(token))
        if len(out) == max_tokens:
            break
    return out
