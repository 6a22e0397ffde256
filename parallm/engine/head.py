"""The model's output projection applied to chosen positions only.

A prefill pass needs logits at one position per finishing prompt (its last token, to sample the
first output token), but mlx-lm's models project every position: for five 45-token prompts of
the default model that is 225 x 576 x 49,152 multiply-adds (12.7 GFLOP, ~40 ms on the 2-core
CPU) to keep five rows. While `OutputHead.select(rows)` is entered, the hidden states reaching the
projection are first gathered to those rows (of the pass's flattened [batch x length] positions),
so the model returns logits [1, len(rows), vocab].

Every supported architecture ends in `self.lm_head(out)` or
`self.model.embed_tokens.as_linear(out)` (then, for some, elementwise soft-capping). The head is
checked once on the real model: logits of selected positions must equal those positions of a
full forward; where they do not (an architecture that projects some other way), `usable` is
False and the engine takes the rows from the full logits instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn


class _Gathered(nn.Module):
    def __init__(self, inner: Any, rows: mx.array) -> None:
        super().__init__()
        self.inner = inner
        self._rows = rows

    def __call__(self, x: mx.array) -> mx.array:
        picked = _gather(x, self._rows)
        at_positions = getattr(self.inner, "at_positions", None)  # an adapted head: its rows' slots follow the rows
        return self.inner(picked) if at_positions is None else at_positions(picked, self._rows, x.shape[1])


def _gather(x: mx.array, rows: mx.array) -> mx.array:
    return x.reshape(-1, x.shape[-1])[rows][None]


class OutputHead:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        inner = getattr(model, "model", None)
        self._embed = getattr(inner, "embed_tokens", None) if inner is not None else None
        self._has_lm_head = isinstance(getattr(model, "lm_head", None), nn.Module)
        self.usable = (self._has_lm_head or hasattr(self._embed, "as_linear")) and self._check()

    @contextmanager
    def select(self, rows: mx.array) -> Iterator[None]:
        """Within the block, the model's logits are those of `rows` (indices into the flattened
        [batch x length] positions of the call), shaped [1, len(rows), vocab]."""
        model, embed = self.model, self._embed
        original_head = model.lm_head if self._has_lm_head else None
        if original_head is not None:
            model.lm_head = _Gathered(original_head, rows)
        if embed is not None and hasattr(embed, "as_linear"):
            project = embed.as_linear
            embed.as_linear = lambda x: project(_gather(x, rows))
        try:
            yield
        finally:
            if original_head is not None:
                model.lm_head = original_head
            if embed is not None and "as_linear" in embed.__dict__:
                del embed.as_linear

    def _check(self) -> bool:
        from mlx_lm.models.cache import make_prompt_cache

        tokens = mx.array([[1, 2, 3], [4, 5, 6]], dtype=mx.int32) % _vocab(self.model)
        try:
            full = self.model(tokens, cache=make_prompt_cache(self.model))
            rows = mx.array([2, 3], dtype=mx.int32)
            with self.select(rows):
                picked = self.model(tokens, cache=make_prompt_cache(self.model))
            want = full.reshape(-1, full.shape[-1])[rows][None]
            return picked.shape == want.shape and bool(mx.allclose(picked, want, rtol=1e-3, atol=1e-3).item())
        except Exception:  # noqa: BLE001 - an architecture this does not fit: use the full logits
            return False


def _vocab(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", 0) or 2)
