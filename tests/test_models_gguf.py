"""GGUF variants: every tensor type and architecture gives the logits of the model the file describes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten

from parallm.config import ModelConfig
from parallm.models import LoadedModel, ModelLoadError, load_model, resolve_model

from models_synth import CONFIGS, TOKENS, build_model, write_gguf

PROMPT = [5, 80, 120, 33, 7, 250, 260, 99, 42, 3, 17, 200]

# Relative logit error of the loaded model against the original float32 weights: the cost of the
# file's own encoding (measured: F16 5e-4, BF16 4e-3, Q8_0 1.2e-2, Q5_0 0.10, Q4_* 0.19-0.20).
ENCODING_NOISE = {"F32": 1e-6, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 4e-2, "Q5_0": 0.2, "Q4_0": 0.35, "Q4_1": 0.35,
                  "Q4_K": 0.35}
# Against the values the file holds, decoded by the gguf package: exact where MLX keeps the
# encoding (repacked or native), float16 rounding where parallm dequantizes (K-quants, Q5_0).
DECODED = {"F32": 1e-6, "F16": 1e-6, "BF16": 1e-6, "Q8_0": 1e-6, "Q4_0": 1e-6, "Q4_1": 1e-6, "Q5_0": 2e-3,
           "Q4_K": 2e-3}


def logits(model: nn.Module, ids: list[int] = PROMPT) -> mx.array:
    return model(mx.array([ids]))[0].astype(mx.float32)


def rel(a: mx.array, b: mx.array) -> float:
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def held_model(config: dict, held: dict[str, mx.array]) -> nn.Module:
    reference = build_model(config)
    reference.update(tree_unflatten(list(held.items())))
    return reference


def load(path: Path, tmp_path: Path, dtype: str = "float32") -> LoadedModel:
    return load_model(ModelConfig(path=str(path), cache_dir=str(tmp_path / "cache"), dtype=dtype))


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return build_model(CONFIGS["llama"])


@pytest.mark.parametrize("qtype", list(ENCODING_NOISE))
def test_llama_tensor_types(tmp_path: Path, llama: nn.Module, qtype: str) -> None:
    config = CONFIGS["llama"]
    held = write_gguf(tmp_path / f"tiny-{qtype}.gguf", "llama", config, llama, qtype)
    loaded = load(tmp_path / f"tiny-{qtype}.gguf", tmp_path)
    assert loaded.dtype == "float32" and loaded.max_model_len == config["max_position_embeddings"]
    assert loaded.vocab_size == len(TOKENS) and loaded.eos_token_ids == [2]
    ours = logits(loaded.model)
    assert rel(ours, logits(held_model(config, held))) < DECODED[qtype]
    assert rel(ours, logits(llama)) < ENCODING_NOISE[qtype]


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_native_quantization_is_kept(tmp_path: Path, llama: nn.Module, qtype: str, bits: int) -> None:
    write_gguf(tmp_path / "tiny.gguf", "llama", CONFIGS["llama"], llama, qtype)
    loaded = load(tmp_path / "tiny.gguf", tmp_path, dtype="quantized")
    assert loaded.dtype == "quantized"
    assert loaded.config["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (bits, 32)
    f32 = load(tmp_path / "tiny.gguf", tmp_path, dtype="float32")
    assert rel(logits(loaded.model), logits(f32.model)) < 2e-2  # same weights, float16 compute


def test_k_quant_is_stored_dequantized(tmp_path: Path, llama: nn.Module) -> None:
    write_gguf(tmp_path / "tiny.gguf", "llama", CONFIGS["llama"], llama, "Q4_K")
    source = resolve_model(ModelConfig(path=str(tmp_path / "tiny.gguf"), cache_dir=str(tmp_path / "cache")))
    assert "quantization" not in json.loads((source.path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="dtype 'quantized' keeps the stored quantization"):
        load(tmp_path / "tiny.gguf", tmp_path, dtype="quantized")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma", "gemma2", "gemma3"])
def test_architectures(tmp_path: Path, arch: str) -> None:
    config = CONFIGS[arch]
    original = build_model(config, seed=1)
    held = write_gguf(tmp_path / "tiny.gguf", arch, config, original, "Q8_0")
    loaded = load(tmp_path / "tiny.gguf", tmp_path)
    assert loaded.source.model_type == config["model_type"]
    for key in ("sliding_window", "query_pre_attn_scalar", "final_logit_softcapping", "head_dim"):
        if key in config:
            assert loaded.config[key] == config[key], key
    assert rel(logits(loaded.model), logits(held_model(config, held))) < 1e-5


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    """Llama 3.1's rope scaling arrives as llama.cpp's rope_freqs factors and is applied exactly."""
    config = {**CONFIGS["llama"], "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}
    original = build_model(config)
    held = write_gguf(tmp_path / "tiny.gguf", "llama", config, original, "F32")
    loaded = load(tmp_path / "tiny.gguf", tmp_path)
    x = mx.random.normal((1, 4, 3, 64), key=mx.random.key(0))
    ours, theirs = loaded.model.model.layers[0].self_attn.rope, original.model.layers[0].self_attn.rope
    for offset in (0, 7, 5000):
        assert mx.allclose(ours(x, offset=offset), theirs(x, offset=offset), atol=1e-4).item()
    unscaled = build_model({**config, "rope_scaling": None})
    assert not mx.allclose(unscaled.model.layers[0].self_attn.rope(x, offset=5000), theirs(x, offset=5000),
                           atol=1e-2).item()
    assert rel(logits(loaded.model), logits(held_model(config, held))) < 1e-5


def _bare_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], tokenizer: bool = True) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(TOKENS)
        writer.add_token_merges(["Ġ t"])
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    _bare_gguf(tmp_path / "f.gguf", "falcon", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(ModelLoadError, match="GGUF architecture 'falcon' is not supported; supported: gemma, "):
        resolve_model(ModelConfig(path=str(tmp_path / "f.gguf"), cache_dir=str(tmp_path / "cache")))
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.suffix != ".lock"] == []


def test_undecodable_tensor_type_is_named(tmp_path: Path, llama: nn.Module) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", CONFIGS["llama"], llama, "F16")
    reader = gguf.GGUFReader(path)
    # Re-write one tensor as Q8_1, a type with no decoder in the gguf package.
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for t in reader.tensors:
        data, raw = np.array(t.data), None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
        if t.name == "blk.0.ffn_up.weight":
            data, raw = np.zeros((data.shape[0], data.shape[1] // 32 * type_size), np.uint8), gguf.GGMLQuantizationType.Q8_1
        writer.add_tensor(t.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight has GGML type Q8_1"):
        resolve_model(ModelConfig(path=str(odd), cache_dir=str(tmp_path / "cache")))


def test_missing_tokenizer_and_bad_files(tmp_path: Path) -> None:
    _bare_gguf(tmp_path / "n.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)},
               tokenizer=False)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        resolve_model(ModelConfig(path=str(tmp_path / "n.gguf"), cache_dir=str(tmp_path / "cache")))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        resolve_model(ModelConfig(path=str(tmp_path / "junk.gguf"), cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(ModelConfig(path=str(tmp_path / "absent.gguf"), cache_dir=str(tmp_path / "cache")))
