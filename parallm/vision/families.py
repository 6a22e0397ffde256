"""The vision-language families whose image input parallm serves, and what differs between them.

A family names its mlx-vlm model module, how many image tokens an image of a given pixel shape takes in
the prompt, and how its vision tower and projector turn pixel values into one feature row per image
token. The language model is the mlx-lm model of the checkpoint's `text_config`, driven by the engine
like any text model; the features replace the image tokens' input embeddings at prefill. Families are
listed only where that is all the model does: a causal text model with 1-D positions (Qwen2-VL's M-RoPE,
Gemma 3's and PaliGemma's bidirectional image attention are not that, so they are refused for images).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["VisionFamily", "FAMILIES", "family_of", "refusal_for_images", "SUPPORTED"]


def _llava_tokens(config: dict, shape: tuple[int, ...]) -> int:
    """LLaVA: one token per vision patch; the CLS token is dropped under the "default" strategy."""
    patch = int(config["vision_config"].get("patch_size", 14))
    _, height, width = shape[-3:]
    return (height // patch) * (width // patch)


def _llava_features(model: Any, pixels: Any) -> Any:
    """[images, tokens, text hidden] from [images, channels, height, width]: the vision tower's
    `vision_feature_layer` hidden states (CLS dropped under "default"), through the projector, as
    mlx-vlm's llava.Model.get_input_embeddings computes them."""
    *_, hidden = model.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
    layer = model.vision_feature_layer
    if isinstance(layer, int):
        selected = hidden[layer]
        if model.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
    else:
        import mlx.core as mx

        pool = [hidden[i] for i in layer]
        if model.vision_feature_select_strategy == "default":
            pool = [h[:, 1:] for h in pool]
        selected = mx.concatenate(pool, axis=-1)
    return model.multi_modal_projector(selected)


@dataclass(frozen=True, slots=True)
class VisionFamily:
    name: str                                              # the checkpoint's model_type
    tokens: Callable[[dict, tuple[int, ...]], int]         # image tokens for one image's pixel shape
    features: Callable[[Any, Any], Any]                    # (mlx-vlm model, pixels) -> [images, tokens, hidden]
    vision_modules: tuple[str, ...]                        # the mlx-vlm model's attributes the encoder keeps
    text_prefix: str = "language_model"                    # where the mlx-vlm model keeps its text model

    def image_token_id(self, config: dict) -> int:
        return int(config.get("image_token_index", config.get("image_token_id", -1)))


FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily("llava", _llava_tokens, _llava_features, ("vision_tower", "multi_modal_projector")),
}
SUPPORTED = tuple(sorted(FAMILIES))


def family_of(config: dict) -> VisionFamily | None:
    """The family of a checkpoint whose images parallm serves, or None (a text model, or a VLM family
    served as text only)."""
    return FAMILIES.get(str(config.get("model_type", "")))


def refusal_for_images(model_type: str) -> str:
    """The message for an image part sent to a model whose images are not served."""
    return (f"this model (model_type '{model_type}') takes text only; image input is served for the "
            f"vision-language families {', '.join(SUPPORTED)}")
