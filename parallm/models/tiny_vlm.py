"""Tiny random-weight vision-language models written as model directories, for the tests and the
vision benchmark (no model hub is reachable in CI or on the lent GPUs), from mlx-vlm's own config
classes: LLaVA (a CLIP vision tower, a two-layer projector, a Llama text model) and Pixtral (Pixtral's
vision tower with 2-D RoPE, a projector, a Mistral text model). The tokenizer is the default model's
(SmolLM2's, chat template included) with the family's image tokens added as special tokens; the image
processor is transformers' CLIP processor (LLaVA) or mlx-vlm's Pixtral processor at a tiny size, so the
directory loads with `mlx_vlm.load` (the reference) and with parallm (the served model) alike."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from parallm.config import ModelConfig
from .resolve import resolve_model

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH = 8  # LLaVA: 4 x 4 patches, 16 image tokens per image (the CLS token is dropped)
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
PIXTRAL_EDGE = 48  # Pixtral keeps the aspect ratio: up to 6 x 6 patches of 8 pixels
FAMILIES = ("llava", "pixtral")


def _tokenizer(path: Path, specials: list[str], source: Path | None = None) -> int:
    """The default model's tokenizer (or the one in `source`) with `specials` added, saved in `path`;
    returns the first one's id."""
    from transformers import AutoTokenizer

    source = source or resolve_model(ModelConfig(path="default"), progress=False).path
    tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.save_pretrained(str(path))
    return int(tok.convert_tokens_to_ids(specials[0]))


def _config(family: str, vocab: int, image_id: int, eos: int) -> dict:
    text = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
                max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "pixtral":
        text = {**text, "model_type": "mistral", "head_dim": 16}
        vision = dict(model_type="pixtral", num_hidden_layers=2, hidden_size=32, head_dim=8, intermediate_size=64,
                      num_attention_heads=4, image_size=PIXTRAL_EDGE, patch_size=PATCH, num_channels=3,
                      rms_norm_eps=1e-5, rope_theta=10000.0)
        return dict(model_type="pixtral", architectures=["LlavaForConditionalGeneration"], text_config=text,
                    vision_config=vision, image_token_index=image_id, vision_feature_select_strategy="full",
                    vision_feature_layer=-1, vocab_size=vocab, eos_token_id=eos)
    if family != "llava":
        raise ValueError(f"no tiny builder for {family!r}")
    vision = dict(model_type="clip_vision_model", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32,
                  num_channels=3, layer_norm_eps=1e-5)
    return dict(model_type="llava", architectures=["LlavaForConditionalGeneration"], text_config=text,
                vision_config=vision, image_token_index=image_id, vision_feature_select_strategy="default",
                vision_feature_layer=-2, vocab_size=vocab, eos_token_id=eos)


def _processor_files(path: Path, family: str, edge: int = PIXTRAL_EDGE, patch: int = PATCH) -> None:
    if family == "pixtral":
        (path / "processor_config.json").write_text(json.dumps({
            "processor_class": "PixtralProcessor", "patch_size": patch, "spatial_merge_size": 1,
            "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
            "image_processor": {"size": {"longest_edge": edge}, "patch_size": {"height": patch, "width": patch},
                                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                "image_std": [0.26862954, 0.26130258, 0.27577711]}}))
        return
    size = {"shortest_edge": IMAGE_SIZE}
    crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": size, "do_center_crop": True,
        "crop_size": crop, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True, "resample": 3}))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": PATCH, "vision_feature_select_strategy": "default",
        "image_token": IMAGE_TOKEN, "num_additional_image_tokens": 1}))


def write_vlm(path: Path, family: str = "llava", seed: int = 0, spread: float = 3.0, text: dict | None = None,
              vision: dict | None = None, edge: int | None = None, tokenizer_dir: Path | None = None) -> Path:
    """A tiny `family` model directory at `path` (config, random weights in mlx-vlm's layout, tokenizer,
    processor files). `spread` scales the random matrices so logits are far from ties; `text` and `vision`
    override config fields (a larger shape for benchmarks) and `edge` Pixtral's longest image edge."""
    from mlx_vlm.utils import get_model_and_args

    path.mkdir(parents=True, exist_ok=True)
    image_id = _tokenizer(path, PIXTRAL_TOKENS if family == "pixtral" else [IMAGE_TOKEN], tokenizer_dir)
    tok = json.loads((path / "tokenizer_config.json").read_text())
    eos = 2 if tok.get("eos_token") == "<|im_end|>" else 0
    cfg = _config(family, image_id + (3 if family == "pixtral" else 1), image_id, eos)
    cfg["text_config"].update(text or {})
    cfg["vision_config"].update(vision or {})
    module, _ = get_model_and_args(cfg)
    model_config = module.ModelConfig.from_dict(cfg)
    model_config.text_config = module.TextConfig.from_dict(cfg["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(cfg["vision_config"])
    model = module.Model(model_config)
    rng = np.random.default_rng(seed)
    params = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight") or "layer_norm" in name and name.endswith("weight"):
            array = 1.0 + 0.1 * rng.standard_normal(value.shape)
        elif name.endswith("bias"):
            array = 0.1 * rng.standard_normal(value.shape)
        elif "embed_tokens" in name or "embedding" in name:
            array = rng.standard_normal(value.shape)
        else:
            fan_in = value.shape[-1] if value.ndim >= 2 else 64
            array = spread * rng.standard_normal(value.shape) / np.sqrt(fan_in)
        params.append((name, mx.array(array.astype(np.float32))))
    model.update(tree_unflatten(params))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(cfg))
    _processor_files(path, family, edge or PIXTRAL_EDGE, cfg["vision_config"]["patch_size"])
    return path


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """A random RGB PNG image."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
