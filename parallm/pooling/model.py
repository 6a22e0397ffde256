"""PoolingModel: a loaded embedding, reward or classifier model that turns token ids into one output
vector per sequence, in batches (prefill-only work: no KV cache, no decode rows)."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .heads import l2_normalize, pool
from .spec import PoolingInfo

# (token ids [B, N], lengths [B]) -> hidden states [B, N, H]
Backbone = Callable[[mx.array, mx.array], mx.array]


class PoolingModel:
    """token ids -> [B, dims] float32: embeddings (pooled, maybe normalized) or head logits."""

    def __init__(self, info: PoolingInfo, backbone: Backbone, tokenizer: Any, params: nn.Module,
                 head: mx.array | None = None):
        self.info = info
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.params = params          # the module holding every weight (for memory figures)
        self.head = head              # [labels, H] score weight of a sequence-classification model

    # ------------------------------------------------------------------ tokenization
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids as the model was trained to see them (special tokens included)."""
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def tokenize_chat(self, conversations: list[list[dict[str, Any]]]) -> list[list[int]]:
        """Chat messages templated as the model's tokenizer templates them (reward models)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"pooling model '{self.info.name}' has no chat template; send text instead")
        texts = [self.tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    # ------------------------------------------------------------------ forward
    def forward(self, batch: list[list[int]]) -> np.ndarray:
        """One batched pass over `batch` (each a non-empty token list within max_len) -> [B, dims]."""
        if not batch:
            return np.zeros((0, self.info.dims), np.float32)
        lengths = [len(ids) for ids in batch]
        if min(lengths) == 0:
            raise ValueError("an input has no tokens")
        if max(lengths) > self.info.max_len:
            raise ValueError(f"an input has {max(lengths)} tokens; {self.info.name} takes at most {self.info.max_len}")
        width = max(lengths)
        padded = np.zeros((len(batch), width), np.int32)
        for row, ids in enumerate(batch):
            padded[row, :len(ids)] = ids
        lens = mx.array(lengths, dtype=mx.int32)
        hidden = self.backbone(mx.array(padded), lens)
        vec = pool(hidden, lens, self.info.pooling)
        if self.head is not None:
            vec = vec @ self.head.astype(mx.float32).T
        elif self.info.normalize:
            vec = l2_normalize(vec)
        mx.eval(vec)
        return np.array(vec, dtype=np.float32)

    def run(self, batch: list[list[int]], max_tokens: int = 8192) -> np.ndarray:
        """forward() in sub-batches of similar length (sorted by length, at most `max_tokens` padded
        tokens each), so one long input does not pad all the short ones; results in input order."""
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        out = np.zeros((len(batch), self.info.dims), np.float32)
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and len(batch[order[end]]) * (end + 1 - start) <= max_tokens:
                end += 1
            rows = order[start:end]
            out[rows] = self.forward([batch[i] for i in rows])
            start = end
        return out
