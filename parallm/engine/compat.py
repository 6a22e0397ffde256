"""Which mlx-lm models the engine drives, and the per-layer KV shapes it needs to know.

The engine hands unmodified mlx-lm models its own per-layer cache views (cache.RowsView). That
works for architectures whose attention only goes through `offset`, `update_and_fetch` and
`make_mask`; the allowlist below holds the ones confirmed by tests (greedy tokens equal to
mlx_lm.generate's with tiny random weights). Others are refused with a clear error rather
than risking silently wrong output.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .cache import LayerShape

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")

# These read `cache.keys` (or other cache internals) directly instead of going through the protocol.
READS_CACHE_INTERNALS = ("deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_5")

# Attention written by hand with the GQA heads split into their own axis, so the mask needs an
# extra axis: [B, 1, 1, L, T] broadcasts against [B, kv_heads, repeats, L, T] scores.
MASK_5D = ("gemma2",)


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_type: str
    shapes: list[LayerShape]
    dtype: mx.Dtype
    mask5d: bool


def model_type_of(model: nn.Module) -> str:
    mt = getattr(model, "model_type", None)
    if mt is None and hasattr(model, "args"):
        mt = getattr(model.args, "model_type", None)
    return str(mt or type(model).__module__.rsplit(".", 1)[-1])


def check_model(model: nn.Module) -> ModelInfo:
    """Refuse what cannot work, then probe the per-layer KV shapes with a one-token forward."""
    mt = model_type_of(model)
    if mt in READS_CACHE_INTERNALS:
        raise UnsupportedModel(f"model type {mt!r} reads KV cache internals directly, which the "
                               f"engine's batched cache cannot serve; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model type {mt!r} is not supported by the engine; supported: "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    if hasattr(model, "make_cache"):
        for c in model.make_cache():
            if type(c) not in (KVCache, RotatingKVCache):
                raise UnsupportedModel(f"model type {mt!r} uses a {type(c).__name__} layer cache; the engine "
                                       "only serves attention KV caches")
    for _, module in model.named_modules():
        if isinstance(module, DynamicNTKScalingRoPE):
            raise UnsupportedModel("dynamic NTK RoPE scaling depends on each sequence's length and cannot "
                                   "be batched over rows of different lengths")
    shapes, dtype = probe_kv_shapes(model)
    return ModelInfo(model_type=mt, shapes=shapes, dtype=dtype, mask5d=mt in MASK_5D)


class _Probe:
    """A one-row, one-token cache that records what each layer stores."""

    def __init__(self, record: list) -> None:
        self._record = record
        self.offset = mx.array([0], dtype=mx.int32)

    def __bool__(self) -> bool:
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._record.append((keys.shape, values.shape, keys.dtype))
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return mx.ones((1, 1, N, N), dtype=mx.bool_)

    @property
    def state(self):
        return ()

    @property
    def nbytes(self) -> int:
        return 0


def probe_kv_shapes(model: nn.Module) -> tuple[list[LayerShape], mx.Dtype]:
    layers = model.layers
    records: list[list] = [[] for _ in layers]
    probes = [_Probe(r) for r in records]
    mx.eval(model(mx.array([[0]]), cache=probes))
    shapes = []
    dtype = None
    for i, r in enumerate(records):
        if len(r) != 1:
            raise UnsupportedModel(f"layer {i} used its cache {len(r)} times in one forward pass; the engine "
                                   "needs exactly one KV update per layer")
        (kb, kh, kl, kd), (vb, vh, vl, vd), dt = r[0]
        if (kb, kl, vb, vl) != (1, 1, 1, 1):
            raise UnsupportedModel(f"layer {i} stored keys {r[0][0]} for one token; expected [1, heads, 1, dim]")
        shapes.append(LayerShape(kh, kd, vh, vd))
        dtype = dtype or dt
    return shapes, dtype
