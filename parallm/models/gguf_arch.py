"""GGUF architectures: their mlx-lm config.json, tensor names, and what llama.cpp changed in the weights.

What llama.cpp's convert_hf_to_gguf.py does that is undone here:
- llama: q/k projection rows are permuted per head from the HF "rotate halves" RoPE layout to the
  "rotate adjacent pairs" layout of ggml's normal RoPE (HF row a*h/2 + i -> GGUF row 2*i + a).
- gemma, gemma2, gemma3: every `*norm.weight` gets +1 (Gemma's RMSNorm scales by 1 + w).
- llama 3.1+: the rope scaling is baked into a `rope_freqs` tensor of per-dimension factors.
Hyperparameters that llama.cpp hard-codes instead of storing (Gemma 3's sliding-window pattern and
local RoPE base, Gemma 2/3's attention scale of the 27B models) follow llama.cpp's rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import mlx.core as mx

from .errors import ModelLoadError

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA2_LAYER = {
    **_LLAMA_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class Meta:
    """GGUF metadata of one architecture: `meta.get("attention.head_count")` reads `<arch>.attention.head_count`."""

    def __init__(self, metadata: Mapping[str, Any], arch: str):
        self.metadata, self.arch = metadata, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks '{self.arch}.{key}', needed for a {self.arch} model")
        return value

    def scalar(self, key: str, default: Any = None) -> Any:
        """A per-model value that some files store per layer: accept a list only if all layers agree."""
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelLoadError(f"'{self.arch}.{key}' differs between layers ({value}); "
                                     "mlx-lm's model has one value for all layers")
            value = value[0]
        return value


@dataclass(frozen=True)
class Arch:
    model_type: str                      # mlx-lm model_type
    layer_names: Mapping[str, str]       # GGUF `blk.N.<name>` -> mlx-lm `model.layers.N.<name>`
    permute_qk: bool = False
    norm_shift: float = 0.0
    rope_scaling: bool = True            # whether mlx-lm's model reads config["rope_scaling"]
    extra: Callable[[Meta, dict], dict] = field(default=lambda meta, base: {})


def _gemma_attention_scale(meta: Meta, base: dict, big_layers: int) -> float:
    # llama.cpp: the 27B models (by layer count) scale by hidden/heads, the others by head_dim.
    if base["num_hidden_layers"] == big_layers:
        return base["hidden_size"] / base["num_attention_heads"]
    return float(base["head_dim"])


def _gemma2(meta: Meta, base: dict) -> dict:
    return {
        "attn_logit_softcapping": meta.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.get("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": _gemma_attention_scale(meta, base, 46),
    }


def _gemma3(meta: Meta, base: dict) -> dict:
    return {
        "query_pre_attn_scalar": _gemma_attention_scale(meta, base, 62),
        "sliding_window": meta.require("attention.sliding_window"),
        "sliding_window_pattern": 6,        # llama.cpp: hparams.set_swa_pattern(6)
        "rope_local_base_freq": 10000.0,    # llama.cpp: rope_freq_base_train_swa = 10000
    }


ARCHES: dict[str, Arch] = {
    "llama": Arch("llama", _LLAMA_LAYER, permute_qk=True),
    "qwen2": Arch("qwen2", _LLAMA_LAYER),
    "qwen3": Arch("qwen3", {**_LLAMA_LAYER, **_QK_NORM}),
    "gemma": Arch("gemma", _LLAMA_LAYER, norm_shift=1.0, rope_scaling=False),
    "gemma2": Arch("gemma2", _GEMMA2_LAYER, norm_shift=1.0, rope_scaling=False, extra=_gemma2),
    "gemma3": Arch("gemma3_text", {**_GEMMA2_LAYER, **_QK_NORM}, norm_shift=1.0, extra=_gemma3),
}


def get_arch(name: str) -> Arch:
    if name not in ARCHES:
        raise ModelLoadError(f"GGUF architecture '{name}' is not supported; supported: {', '.join(sorted(ARCHES))}")
    return ARCHES[name]


def _rope_scaling(meta: Meta, arch: Arch, shapes: Mapping[str, tuple], arrays: Mapping[str, mx.array],
                  max_positions: int) -> dict | None:
    if "rope_freqs.weight" in shapes:
        if arch.model_type != "llama":
            raise ModelLoadError(f"{meta.arch} GGUF carries a rope_freqs tensor, which parallm supports for llama only")
        # Llama 3.1+ rope scaling, baked by llama.cpp into per-dimension factors (theta_i /= f_i).
        # mlx-lm's SuScaledRoPE divides by the same per-dimension factors, and with the original
        # context equal to the current one it applies no extra attention scale: the same RoPE.
        factors = [float(x) for x in arrays["rope_freqs.weight"].astype(mx.float32).tolist()]
        return {"type": "longrope", "long_factor": factors, "short_factor": factors,
                "original_max_position_embeddings": max_positions}
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor") or meta.get("rope.scale_linear")
    if kind in (None, "none") and factor in (None, 0, 1, 1.0):
        return None
    if kind in (None, "linear") and factor:
        return {"type": "linear", "factor": float(factor)}
    raise ModelLoadError(f"GGUF rope scaling '{kind}' (factor {factor}) is not supported; supported: none, linear"
                         + (", llama 3 (rope_freqs)" if arch.model_type == "llama" else ""))


def build_config(metadata: Mapping[str, Any], shapes: Mapping[str, tuple],
                 arrays: Mapping[str, mx.array]) -> dict:
    """The mlx-lm config.json for a GGUF file (without the quantization section)."""
    arch_name = metadata.get("general.architecture")
    arch = get_arch(arch_name)
    meta = Meta(metadata, arch_name)
    hidden = int(meta.require("embedding_length"))
    heads = int(meta.scalar("attention.head_count"))
    kv_heads = int(meta.scalar("attention.head_count_kv", heads))
    head_dim = int(meta.get("attention.key_length") or hidden // heads)
    if meta.get("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{arch_name} GGUF has key_length {head_dim} != value_length "
                             f"{meta.get('attention.value_length')}; unsupported")
    if meta.get("rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{arch_name} GGUF rotates {meta.get('rope.dimension_count')} of {head_dim} head "
                             "dimensions (partial RoPE); mlx-lm's model for it rotates all of them")
    if "token_embd.weight" not in shapes:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    max_positions = int(meta.require("context_length"))
    config = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.require("block_count")),
        "intermediate_size": int(meta.scalar("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.require("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(shapes["token_embd.weight"][0]),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in shapes
    scaling = _rope_scaling(meta, arch, shapes, arrays, max_positions)
    if scaling is not None:
        if not arch.rope_scaling:
            raise ModelLoadError(f"{arch_name} GGUF uses rope scaling {scaling}, which mlx-lm's "
                                 f"'{arch.model_type}' model does not implement")
        config["rope_scaling"] = scaling
    config.update(arch.extra(meta, config))
    return config


def _unpermute(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head row permutation (GGUF row 2*i + a -> HF row a*h/2 + i)."""
    shape = x.shape
    return x.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)$")


def map_tensors(metadata: Mapping[str, Any], arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """GGUF tensors (mx.load naming) -> mlx-lm weights, with llama.cpp's changes undone."""
    arch_name = metadata["general.architecture"]
    arch, meta = get_arch(arch_name), Meta(metadata, arch_name)
    heads = int(meta.scalar("attention.head_count"))
    kv_heads = int(meta.scalar("attention.head_count_kv", heads))
    out: dict[str, mx.array] = {}
    for name, array in arrays.items():
        base, suffix = name.rsplit(".", 1)
        if base == "rope_freqs":
            continue  # became config["rope_scaling"]
        layer = _LAYER_NAME.match(base)
        if layer is not None and layer[2] in arch.layer_names:
            new_base = f"model.layers.{layer[1]}.{arch.layer_names[layer[2]]}"
        elif layer is None and base in _GLOBAL:
            new_base = _GLOBAL[base]
        else:
            raise ModelLoadError(f"{arch_name} GGUF tensor '{name}' has no counterpart in mlx-lm's "
                                 f"'{arch.model_type}' model; this variant is not supported")
        if arch.permute_qk and layer is not None and layer[2] in ("attn_q", "attn_k"):
            array = _unpermute(array, heads if layer[2] == "attn_q" else kv_heads)
        if arch.norm_shift and base.endswith("norm") and suffix == "weight":
            array = (array.astype(mx.float32) - arch.norm_shift).astype(array.dtype)
        out[f"{new_base}.{suffix}"] = array
    return out
