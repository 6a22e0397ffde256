"""Random-weight model directories of real models' shapes (named in `SHAPES`), for benchmarks and
end-to-end tests: decode throughput and memory depend on the shape, not on the weights, and no model
hub is reachable on the lent GPUs or in CI. `build_model_dir` saves an mlx-lm model directory with a
borrowed tokenizer; a quantized shape is filled and quantized one block at a time so that a 30B MoE
builds on one 80 GB card.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072, dtype="bfloat16"),
    # Llama-3.2-1B's shape, 4-bit (the trainer's QLoRA memory figure on the CPU, issue 33)
    "llama-3.2-1b-4bit": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                              vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                              max_position_embeddings=131072, dtype="bfloat16", quantize_bits=4),
    # speculative decoding's draft models (spec.mode draft, issue 36): a tiny one for the default model's
    # vocabulary (CPU tests and benchmarks; built with the default tokenizer), and a small one for
    # llama-3.2-3b's (the GPU benchmark's draft: 4 layers of 1024, ~0.18B parameters with the embeddings)
    "tiny-draft": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       vocab_size=49152, rope_theta=10000.0, tie_word_embeddings=True,
                       max_position_embeddings=8192, dtype="float32"),
    "llama-draft-small": dict(model_type="llama", hidden_size=1024, num_hidden_layers=4, intermediate_size=2816,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5,
                              vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                              max_position_embeddings=131072, dtype="bfloat16"),
    # a tiny 4-bit llama (CPU smoke runs of the GPU entries that want a quantized model)
    "tiny-4bit": dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, vocab_size=50000,
                      rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096, dtype="float32",
                      quantize_bits=4),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False,
                     max_position_embeddings=40960, dtype="bfloat16", quantize_bits=4),
    # the default model's shape (SmolLM2-135M-Instruct), for the adapter benchmark on a GPU
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, dtype="bfloat16"),
    # Qwen3-30B-A3B (and Qwen3-Coder-30B-A3B): 128 experts, 8 active, 4-bit like mlx-community's quants;
    # filled and quantized a block at a time (build_model_dir), so it builds on one 80 GB card
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, rms_norm_eps=1e-6, vocab_size=151936, rope_theta=1000000.0,
                          tie_word_embeddings=False, max_position_embeddings=40960, dtype="bfloat16",
                          quantize_bits=4),
    # a small MoE of the same family (CPU smoke runs, the MoE end-to-end test's model)
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                     mlp_only_layers=[], norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, rms_norm_eps=1e-6, vocab_size=50000, rope_theta=10000.0,
                     tie_word_embeddings=True, max_position_embeddings=4096, dtype="float32"),
    # a Qwen3.5-4B-like hybrid (gated delta-net layers, full attention every 4th layer; dims in the
    # range of the Qwen3-Next/Qwen3.5 family, not copied from a released config), bfloat16
    "qwen3.5-4b-hybrid": dict(model_type="qwen3_5", hidden_size=2560, num_hidden_layers=32, intermediate_size=9216,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_value_heads=32,
                              linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                              linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                              vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                              rope_parameters={"type": "default", "rope_theta": 10000000.0,
                                               "partial_rotary_factor": 0.25}, dtype="bfloat16"),
    # a tiny hybrid of the same kind (CPU smoke runs, the hybrid end-to-end test's model)
    "tiny-hybrid": dict(model_type="qwen3_5", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6, vocab_size=50000,
                        tie_word_embeddings=True, max_position_embeddings=4096,
                        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                        dtype="float32"),
    # Llama-3.2-3B's 28 layers and grouped heads at a width where a one-row decode step on a CPU is host work
    # (Python, MLX graph building, op dispatch), as the 3B's one-row step is on an H200: the single stream's
    # stand-in for CPU runs (perf/bench_single_stream.py, issue 37)
    "tiny-deep": dict(model_type="llama", hidden_size=64, num_hidden_layers=28, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      vocab_size=49152, rope_theta=500000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192, dtype="float32"),
    "tiny": dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, vocab_size=50000,
                 rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096, dtype="float32"),
}


def build_model_dir(shape: str, out: Path, tokenizer_dir: Path, vocab_size: int | None = None) -> Path:
    """Random weights of `shape`, saved as an mlx-lm model directory (reused if present); `vocab_size`
    replaces the shape's (the tokenizer's size, so that every sampled id decodes to real text)."""
    spec = dict(SHAPES[shape])
    if vocab_size:
        spec["vocab_size"] = vocab_size
    dtype = spec.pop("dtype")
    bits = spec.pop("quantize_bits", 0)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {**spec, "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2}
    (tmp / "config.json").write_text(json.dumps(config))
    arch = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.random.seed(0)
    if bits:
        # one block at a time, quantized as soon as it is filled: the full-precision model of a 30B
        # MoE (~61 GB) never exists whole, so it builds on one 80 GB card
        for layer in model.layers:
            _fill_random(layer, dtype)
            nn.quantize(layer, group_size=64, bits=bits)
            mx.eval(layer.parameters())
        _fill_random(model, dtype, skip=lambda name: ".layers." in f".{name}")
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
        mx.eval(model.parameters())
    else:
        _fill_random(model, dtype)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(out)
    return out


def _fill_random(module: nn.Module, dtype: str, skip: Any = None) -> None:
    """N(0, 0.02) weights (ones for norms) for every parameter of `module` not `skip`ped, evaluated one
    at a time so that peak memory is the model plus one tensor."""
    params = []
    for name, p in tree_flatten(module.parameters()):
        if skip is not None and skip(name):
            continue
        value = mx.ones(p.shape) if "norm" in name else mx.random.normal(p.shape) * 0.02
        params.append((name, value.astype(getattr(mx, dtype))))
        mx.eval(params[-1][1])
    module.load_weights(params, strict=False)
    mx.eval(module.parameters())
