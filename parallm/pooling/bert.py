"""A BERT encoder in MLX (BertModel / RobertaModel / XLMRobertaModel layouts), for embedding models.

Our own ~100 lines rather than `mlx-embeddings`: that package requires mlx-vlm and transformers>=5
(a vision stack and a transformers major version this project does not pin), for one encoder.
The weights load by their Hugging Face names (`embeddings.word_embeddings.weight`,
`encoder.layer.N.attention.self.query.weight`, ...), with or without a `bert.`/`roberta.` prefix.
"""

from __future__ import annotations

import math
from functools import partial
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import kernels

@dataclass(frozen=True)
class BertArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    # RoBERTa numbers positions from pad_token_id + 1; BERT from 0
    position_offset: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BertArgs":
        roberta = config.get("model_type") in ("roberta", "xlm-roberta")
        return cls(vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
                   num_hidden_layers=int(config["num_hidden_layers"]),
                   num_attention_heads=int(config["num_attention_heads"]),
                   intermediate_size=int(config["intermediate_size"]),
                   max_position_embeddings=int(config["max_position_embeddings"]),
                   type_vocab_size=int(config.get("type_vocab_size", 2)),
                   layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                   hidden_act=str(config.get("hidden_act", "gelu")),
                   position_offset=int(config.get("pad_token_id", 1)) + 1 if roberta else 0)


# erf(x) as Eigen's and XLA's float32 rational approximation on [-4, 4] (x * P(x^2) / Q(x^2); erf is +-1 in
# float32 outside). Only multiplies, adds and one divide: MLX's CPU backend computes erf, exp and tanh an
# element at a time (65 ms for erf over 32x32x1536 values where a multiply takes 0.3 ms), which made GELU
# 80% of a MiniLM pass; this one takes 8 ms compiled. Largest error against mx.erf: 4.4e-7 (GELU: 1.4e-6).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _erf(x: mx.array) -> mx.array:
    x = mx.clip(x, -4.0, 4.0)
    x2 = x * x
    p = mx.array(_ERF_P[0], x.dtype)
    for c in _ERF_P[1:]:
        p = p * x2 + c
    q = mx.array(_ERF_Q[0], x.dtype)
    for c in _ERF_Q[1:]:
        q = q * x2 + c
    return x * p / q


@partial(mx.compile, shapeless=True)  # elementwise: one kernel for every shape
def gelu(x: mx.array) -> mx.array:
    """The exact (erf) GELU, through the rational erf above."""
    return 0.5 * x * (1.0 + _erf(x * 0.7071067811865476))


_ACTS = {"gelu": gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx, "relu": nn.relu}


class _Embeddings(nn.Module):
    def __init__(self, a: BertArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size)
        self.LayerNorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self._offset = a.position_offset

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1]) + self._offset
        x = self.word_embeddings(ids) + self.position_embeddings(positions)[None]
        x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, a: BertArgs):
        super().__init__()
        self.query = nn.Linear(a.hidden_size, a.hidden_size)
        self.key = nn.Linear(a.hidden_size, a.hidden_size)
        self.value = nn.Linear(a.hidden_size, a.hidden_size)


class _Dense(nn.Module):
    def __init__(self, n_in: int, n_out: int, eps: float | None = None):
        super().__init__()
        self.dense = nn.Linear(n_in, n_out)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(n_out, eps=eps)


class _Attention(nn.Module):
    def __init__(self, a: BertArgs):
        super().__init__()
        self.self = _SelfAttention(a)
        self.output = _Dense(a.hidden_size, a.hidden_size, a.layer_norm_eps)
        self.heads = a.num_attention_heads
        self.scale = 1.0 / math.sqrt(a.hidden_size // a.num_attention_heads)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        """`mask`: [B, 1, 1, N] booleans, True for the keys that exist."""
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.self.query(x)), split(self.self.key(x)), split(self.self.value(x))
        if x.dtype == mx.float32 and mx.default_device() == mx.cpu:  # exp without libm (parallm/kernels.py)
            o = kernels.scaled_dot_product_attention(q, k, v, None, self.scale, mask)
        else:
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(b, n, d)
        return self.output.LayerNorm(x + self.output.dense(o))


class _Layer(nn.Module):
    def __init__(self, a: BertArgs):
        super().__init__()
        self.attention = _Attention(a)
        self.intermediate = _Dense(a.hidden_size, a.intermediate_size)
        self.output = _Dense(a.intermediate_size, a.hidden_size, a.layer_norm_eps)
        self.act = _ACTS[a.hidden_act]

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(x, mask)
        return self.output.LayerNorm(h + self.output.dense(self.act(self.intermediate.dense(h))))


class _Encoder(nn.Module):
    def __init__(self, a: BertArgs):
        super().__init__()
        self.layer = [_Layer(a) for _ in range(a.num_hidden_layers)]


class BertEncoder(nn.Module):
    """Token ids [B, N] (right-padded) and their lengths [B] -> last hidden states [B, N, hidden]."""

    def __init__(self, args: BertArgs):
        super().__init__()
        if args.hidden_act not in _ACTS:
            raise ValueError(f"hidden_act '{args.hidden_act}' is not supported ({', '.join(_ACTS)})")
        self.args = args
        self.embeddings = _Embeddings(args)
        self.encoder = _Encoder(args)

    def __call__(self, ids: mx.array, lengths: mx.array) -> mx.array:
        x = self.embeddings(ids)
        mask = (mx.arange(ids.shape[1])[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, N] keys that exist
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF names -> ours: drop the model prefix, the pooler and buffers (position_ids)."""
        out = {}
        for name, value in weights.items():
            for prefix in ("bert.", "roberta.", "model."):
                if name.startswith(prefix):
                    name = name[len(prefix):]
            if name.startswith(("embeddings.", "encoder.")) and not name.endswith(("position_ids", "token_type_ids")):
                out[name] = value
        return out
