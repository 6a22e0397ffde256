"""Synthetic GGUF files for the model-loading tests.

A tiny mlx-lm model with random weights is written the way llama.cpp's convert_hf_to_gguf.py
writes the real thing: tensor names from the `gguf` package's own HF->GGUF name map (not from
parallm's table), llama q/k rows permuted for ggml's RoPE, Gemma norms stored as 1 + w, 2-D
weights encoded in the requested GGML type and 1-D tensors in F32. The values the file really
holds (quantized, then decoded by the `gguf` package) are returned, so a test can build the
exact reference model they describe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten, tree_unflatten

Q = gguf.GGMLQuantizationType


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
            "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_BASE = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, vocab_size=len(TOKENS),
             max_position_embeddings=4096, rope_theta=10000.0)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_BASE, "model_type": "llama", "tie_word_embeddings": False},
    "qwen2": {**_BASE, "model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1e6},
    "qwen3": {**_BASE, "model_type": "qwen3", "tie_word_embeddings": False, "rope_theta": 1e6},
    "gemma": {**_BASE, "model_type": "gemma"},
    "gemma2": {**_BASE, "model_type": "gemma2", "query_pre_attn_scalar": 64.0,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # mlx-lm's gemma3_text needs one full sliding-window pattern (6 layers) to build its masks.
    "gemma3": {**_BASE, "model_type": "gemma3_text", "num_hidden_layers": 6, "query_pre_attn_scalar": 64.0,
               "sliding_window": 4,
               "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "rope_theta": 1e6},
}


def build_model(config: dict, seed: int = 0) -> Any:
    """An mlx-lm model of this config with random float32 weights of a realistic scale."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    gemma = config["model_type"].startswith("gemma")
    params = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            noise = 0.1 * rng.standard_normal(value.shape)
            array = noise if gemma else 1.0 + noise  # Gemma's norms scale by 1 + w
        elif "embed_tokens" in name:
            array = rng.standard_normal(value.shape)
        else:
            fan_in = value.shape[-1] if value.ndim == 2 else 64
            array = rng.standard_normal(value.shape) / np.sqrt(fan_in)
        params.append((name, mx.array(array.astype(np.float32))))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Encode float rows as Q4_K blocks (the `gguf` package decodes but cannot encode K-quants).

    A plain min/max encoder: 8 sub-blocks of 32 with 6-bit scales and mins under a float16 super
    scale and super min, 4-bit values; byte layout as gguf.quants.Q4_K.dequantize_blocks reads it.
    """
    rows, cols = x.shape
    assert cols % 256 == 0, "Q4_K blocks hold 256 values"
    f32 = np.float32
    blocks = x.reshape(-1, 8, 32).astype(f32)
    low, high = np.minimum(blocks.min(-1), 0), blocks.max(-1)
    sub_scale, sub_min = (high - low) / 15, -low
    d, dmin = (sub_scale.max(-1) / 63).astype(np.float16), (sub_min.max(-1) / 63).astype(np.float16)
    safe = lambda a: np.where(a == 0, 1, a).astype(f32)  # noqa: E731
    sc = np.clip(np.round(sub_scale / safe(d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(sub_min / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    step, offset = d.astype(f32)[:, None] * sc, dmin.astype(f32)[:, None] * mn
    q = np.clip(np.round((blocks + offset[..., None]) / safe(step)[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
    ], axis=1).astype(np.uint8)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales, qs], axis=1)
    return out.reshape(rows, -1)


def encode(x: np.ndarray, qtype: str) -> tuple[np.ndarray, Any, np.ndarray]:
    """(data for GGUFWriter.add_tensor, raw_dtype, the float32 values the file then holds)."""
    if qtype == "F32":
        return x, None, x
    if qtype == "F16":
        data = x.astype(np.float16)
        return data, None, data.astype(np.float32)
    kind = Q[qtype]
    data = quantize_q4_k(x) if qtype == "Q4_K" else quantize(x, kind)
    return data, kind, dequantize(data, kind).reshape(x.shape).astype(np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF row a*h/2 + i -> GGUF row 2*i + a."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(config: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3."""
    s = config["rope_scaling"]
    dim, base = config["head_dim"], config["rope_theta"]
    old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"],
                              s["high_freq_factor"], s["factor"])
    out = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, arch: str, config: dict, model: Any, qtype: str, *,
               tokenizer: bool = True, extra: dict[str, Any] | None = None) -> dict[str, mx.array]:
    """Write `model` as a GGUF of architecture `arch` with 2-D weights in `qtype`.

    Returns the weights (mlx-lm names and layout) as the file holds them after decoding.
    """
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
    if "attn_logit_softcapping" in config:
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(TOKENS)
        writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(TEMPLATE)
    for key, value in (extra or {}).items():
        writer.add_key_value(key, value[0], value[1])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    held: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        x = np.array(value.astype(mx.float32))
        if x.ndim == 2:
            data, raw, decoded = encode(x, qtype)
        else:
            data, raw, decoded = x, None, x
        held[name] = mx.array(decoded)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            n = heads if base.endswith("q_proj") else kv_heads
            data = _permute(data, n)
        if arch.startswith("gemma") and base.endswith("norm"):
            data = data + np.float32(1.0)
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
    if config.get("rope_scaling", {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
