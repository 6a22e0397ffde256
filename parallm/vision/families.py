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


def _pixtral_grid(config: dict, shape: tuple[int, ...]) -> tuple[int, int]:
    patch = int(config["vision_config"].get("patch_size", 16)) * int(config.get("spatial_merge_size", 1))
    _, height, width = shape[-3:]
    return height // patch, width // patch


def _pixtral_tokens(config: dict, shape: tuple[int, ...]) -> int:
    rows, cols = _pixtral_grid(config, shape)
    return rows * cols


def _pixtral_layout(config: dict, shape: tuple[int, ...], ids: dict[str, int]) -> list[int]:
    """Pixtral: a row of [IMG] per patch row, [IMG_BREAK] between rows, [IMG_END] last (PixtralProcessor)."""
    rows, cols = _pixtral_grid(config, shape)
    out: list[int] = []
    for r in range(rows):
        out += [ids["image"]] * cols + [ids["break"] if r < rows - 1 else ids["end"]]
    return out


def _pixtral_features(model: Any, pixels: Any) -> Any:
    """[1, patches, text hidden]: the Pixtral vision tower's `vision_feature_layer` hidden states of one
    unpadded image, through the projector (mlx-vlm's pixtral.Model.get_input_embeddings)."""
    _, _, height, width = pixels.shape
    *_, hidden = model.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True,
                                    image_sizes=[(height, width)])
    return model.multi_modal_projector(hidden[model.vision_feature_layer])


def _one_token_per_feature(tokens: Callable[[dict, tuple[int, ...]], int]):
    def layout(config: dict, shape: tuple[int, ...], ids: dict[str, int]) -> list[int]:
        return [ids["image"]] * tokens(config, shape)
    return layout


@dataclass(frozen=True, slots=True)
class VisionFamily:
    name: str                                              # the checkpoint's model_type
    tokens: Callable[[dict, tuple[int, ...]], int]         # feature rows (image tokens) for one image's pixel shape
    features: Callable[[Any, Any], Any]                    # (mlx-vlm model, pixels) -> [images, tokens, hidden]
    layout: Callable[[dict, tuple[int, ...], dict[str, int]], list[int]]  # the ids one image takes in the prompt
    specials: tuple[str, ...] = ()                         # the processor's other image tokens: ids[name] in layout
    text_prefix: str = "language_model"                    # where the mlx-vlm model keeps its text model

    def image_token_id(self, config: dict) -> int:
        value = config.get("image_token_index")
        return int(value if value is not None else config.get("image_token_id", -1))


FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily("llava", _llava_tokens, _llava_features, _one_token_per_feature(_llava_tokens)),
    "pixtral": VisionFamily("pixtral", _pixtral_tokens, _pixtral_features, _pixtral_layout,
                            specials=("break", "end")),
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
