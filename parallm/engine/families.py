"""Adapters for the model families whose forward reads integer positions from its cache.

The engine's cache views hand a model per-row offsets (an mx.array [rows]); a few mlx-lm
families build masks or position-dependent scales from `cache.offset` as a Python integer and
so cannot run batched rows as written. For each such family an adapter swaps the class of the
affected modules (parameters, names and weights unchanged) for a subclass whose forward does
the same arithmetic per row when the cache is an engine view, and calls mlx-lm's own forward
otherwise (mlx-lm's caches: the reference decoding the tests and the load check compare with).

- llama4: the text model's chunked-attention mask (keys in the query's own chunk of
  `attention_chunk_size` tokens, causal) comes from `ChunkedKVCache.start_position` and an
  integer offset; the views keep every key of a row (no front trimming), so the adapted forward
  narrows the view's causal mask to each query's chunk instead. The NoPE layers' attention
  temperature (`attn_temperature_tuning`) grows with each token's position: per row here.
- afm7: the KV-reuse layers attend over the last cache's keys and rotate their queries at
  `S - L` (S: the fetched keys' length, one sequence's); the views fetch the pass's span, so the
  queries are rotated at each row's own offset instead.
- gpt_bigcode: learned position embeddings looked up at `np.arange(offset, offset + L)`; per
  row here (each row's offset plus 0..L-1, as gpt2's forward already does).
- deepseek_v32 / glm_moe_dsa (DeepSeek sparse attention): the indexer's key cache and the latent
  KV are plain KV rows, but the attention reads `cache.keys` and assigns `cache.keys` /
  `cache.values` (`mx.depends`, to keep mlx-lm's own caches evaluated). The adapted attention
  hands its layer's views through `Assignable`: `keys`/`values` read what the view last fetched,
  and assignments are dropped (the engine evaluates its buffers every step). Rows shorter than
  `index_topk` keys select all of their own keys plus masked ones, which the mask drops: the same
  dense attention mlx-lm runs for them.

`adapt(model)` installs whatever applies (idempotent); `parallm.engine.compat.check_model` calls it.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

import mlx.core as mx
import mlx.nn as nn


def _per_row(cache: Any) -> bool:
    """Whether `cache` is an engine view (per-row offsets), not one of mlx-lm's own caches."""
    return cache is not None and isinstance(getattr(cache, "offset", None), mx.array)


@functools.cache
def _llama4_classes():
    from mlx_lm.models import llama4  # its functions are looked up per call: the engine's fast math patches them

    class ChunkedLlamaModel(llama4.LlamaModel):
        def __call__(self, inputs: mx.array, cache=None):
            if cache is None or not _per_row(cache[0]):
                return super().__call__(inputs, cache)
            h = self.embed_tokens(inputs)
            L = h.shape[1]
            causal = cache[0].make_mask(L, return_array=True)  # [rows, 1, L, T] (or one row's [.., L, L])
            T = causal.shape[-1]
            queries = cache[0].offset.reshape(-1, 1) + mx.arange(L)  # [rows, L]
            keys = mx.arange(T)
            C = self.attention_chunk_size
            same_chunk = (keys[None, None, :] // C) == (queries[:, :, None] // C)  # [rows, L, T]
            chunk_mask = causal & same_chunk[:, None]
            global_mask = llama4.create_attention_mask(h, cache[3])
            for idx, (layer, c) in enumerate(zip(self.layers, cache)):
                h = layer(h, chunk_mask if (idx + 1) % 4 != 0 else global_mask, cache=c)
            return self.norm(h)

    class RowsAttention(llama4.Attention):
        def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
            if not _per_row(cache) or self.use_rope or not self.attn_temperature_tuning:
                return super().__call__(x, mask, cache)
            B, L, _ = x.shape  # a NoPE layer with temperature tuning: the scale per row and position
            queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            positions = cache.offset.reshape(-1, 1) + mx.arange(1, L + 1)  # [rows, L]
            scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
            queries = (queries * scales[:, None, :, None]).astype(queries.dtype)
            keys, values = cache.update_and_fetch(keys, values)
            out = llama4.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    return {llama4.LlamaModel: ChunkedLlamaModel, llama4.Attention: RowsAttention}


class Assignable:
    """A cache view whose `keys` / `values` may be read (the last update_and_fetch's) and assigned (ignored)."""

    def __init__(self, view: Any) -> None:
        object.__setattr__(self, "_view", view)
        object.__setattr__(self, "_fetched", None)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        fetched = self._view.update_and_fetch(keys, values)
        object.__setattr__(self, "_fetched", fetched)
        return fetched

    @property
    def keys(self) -> mx.array:
        return self._fetched[0]

    @property
    def values(self) -> mx.array:
        return self._fetched[1]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("keys", "values"):
            raise AttributeError(f"a cache view's {name} is not assignable")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    def __bool__(self) -> bool:
        return True


@functools.cache
def _dsa_classes():
    from mlx_lm.models import deepseek_v32

    class RowsDSAAttention(deepseek_v32.DeepseekV32Attention):
        def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
            if cache is not None and _per_row(cache[0]):
                cache = [Assignable(cache[0]), Assignable(cache[1])]
            return super().__call__(x, mask, cache)

    return {deepseek_v32.DeepseekV32Attention: RowsDSAAttention}


@functools.cache
def _bigcode_classes():
    from mlx_lm.models import gpt_bigcode

    class RowsBigCodeModel(gpt_bigcode.GPTBigCodeModel):
        def __call__(self, inputs: mx.array, cache=None):
            if cache is None or not _per_row(cache[0]):
                return super().__call__(inputs, cache)
            h = self.wte(inputs)
            mask = gpt_bigcode.create_attention_mask(h, cache[0])
            h = h + self.wpe(cache[0].offset.reshape(-1, 1) + mx.arange(inputs.shape[1]))
            for layer, c in zip(self.h, cache):
                h = layer(h, mask, cache=c)
            return self.ln_f(h)

    return {gpt_bigcode.GPTBigCodeModel: RowsBigCodeModel}


_kv_reuse_offsets: contextvars.ContextVar[mx.array | None] = contextvars.ContextVar("kv_reuse_offsets", default=None)


@functools.cache
def _afm7_classes():
    from mlx_lm.models import afm7

    class RowsAFMModel(afm7.AFMModel):
        def __call__(self, inputs: mx.array, cache=None):
            if cache is None or not _per_row(cache[-1]):
                return super().__call__(inputs, cache)
            token = _kv_reuse_offsets.set(cache[-1].offset)  # the rows' positions before this pass
            try:
                return super().__call__(inputs, cache)
            finally:
                _kv_reuse_offsets.reset(token)

    class RowsKVReuseAttention(afm7.KVReuseAttention):
        def __call__(self, x: mx.array, keys: mx.array, values: mx.array, mask=None) -> mx.array:
            offsets = _kv_reuse_offsets.get()
            if offsets is None:
                return super().__call__(x, keys, values, mask)
            B, L, _ = x.shape
            queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            queries = self.q_norm(self.rope(queries, offset=offsets))
            out = afm7.scaled_dot_product_attention(queries, keys, values, cache=None, scale=self.scale, mask=mask)
            return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    return {afm7.AFMModel: RowsAFMModel, afm7.KVReuseAttention: RowsKVReuseAttention}


_ADAPTERS = {"llama4": _llama4_classes, "afm7": _afm7_classes, "deepseek_v32": _dsa_classes, "glm_moe_dsa": _dsa_classes,
             "gpt_bigcode": _bigcode_classes}
# mlx-lm cache classes an adapted family's slots may use, served as plain KV rows
KV_STAND_INS = {"llama4": ("ChunkedKVCache",)}


def adapt(model: nn.Module, model_type: str) -> bool:
    """Install `model_type`'s adapter on `model` if it has one; whether it has."""
    make = _ADAPTERS.get(model_type)
    if make is None:
        return False
    swaps = make()
    adapted = set(swaps.values())
    for _, module in model.named_modules():
        cls = type(module)
        if cls in swaps:
            module.__class__ = swaps[cls]
        elif cls not in adapted and any(isinstance(module, base) for base in swaps):
            raise TypeError(f"{model_type}: {cls.__name__} subclasses a module the adapter replaces; not adapted")
    return True
