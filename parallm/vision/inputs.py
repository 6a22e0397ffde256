"""The tokenizer stage's side of image input: a request's image parts -> pixel tensors for the engine, and
the prompt's image placeholders expanded to the runs of image tokens the model's features fill.

The chat template sees each image part as the model's image token (templating.content_text); after
tokenizing, each such token is expanded to as many as the image's features (families.py), so the ids
the engine gets are the ids mlx-vlm's own processor makes. Pixel values come from the checkpoint's own
image processor (transformers', as mlx-vlm loads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..protocol import Tensor, pack_tensor
from .families import VisionFamily, family_of, refusal_for_images
from .fetch import IMAGE_PART_TYPES, ImageError, ImageLimits, fetch_image, image_url_of

__all__ = ["ImageInputs", "image_parts", "request_images", "as_image_url", "load_image_inputs"]


def as_image_url(value: Any) -> str:
    """An image as RL clients send it, as a URL: a data: or http(s) URL as is, {"url": ...} (OpenAI's
    image_url object), bytes of an image file, or base64 text without a prefix (TRL's pil_to_base64)."""
    if isinstance(value, dict):
        value = value.get("url", value.get("image_url"))
    if isinstance(value, (bytes, bytearray)):
        import base64

        return "data:image/*;base64," + base64.b64encode(bytes(value)).decode()
    if not isinstance(value, str) or not value:
        raise ImageError("an image must be a data: or http(s) URL, base64 text or image bytes", "images")
    if value.startswith(("data:", "http://", "https://")) or "://" in value[:16]:
        return value
    return "data:image/*;base64," + value


def request_images(message: Any) -> list[tuple[str, str]]:
    """(where, url) of a TextSubmit's images: its messages' image parts, or its `images`; not both."""
    parts = image_parts(message.messages) if message.messages is not None else []
    if parts and message.images:
        raise ImageError("give images as the messages' image_url parts or in images, not both", "images")
    return parts or [(f"images[{i}]", url) for i, url in enumerate(message.images)]


def image_parts(messages: Sequence[Any]) -> list[tuple[str, str]]:
    """(where, url) of every image part of chat messages, in prompt order."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                where = f"messages[{i}].content[{j}]"
                out.append((where, image_url_of(part, where)))
    return out


class ImageInputs:
    """A vision-language checkpoint's image processor, image token and limits."""

    def __init__(self, family: VisionFamily, config: dict, image_processor: Any, image_token: str,
                 limits: ImageLimits, special_ids: dict[str, int] | None = None) -> None:
        self.family, self.config, self.processor, self.limits = family, config, image_processor, limits
        self.image_token = image_token
        self.image_token_id = family.image_token_id(config)
        self.ids = {"image": self.image_token_id, **(special_ids or {})}  # what family.layout writes

    def pixels(self, image: Any) -> np.ndarray:
        """One image's pixel values, [channels, height, width], as the checkpoint's processor makes them."""
        return np.asarray(self.processor([image], return_tensors="np")["pixel_values"][0], dtype=np.float32)

    def prepare(self, ids: list[int], parts: list[tuple[str, str]],
                prompt_param: str = "messages") -> tuple[list[int], list[Tensor]]:
        """The prompt ids with each image placeholder expanded, and the images' pixel tensors (`prompt_param`:
        what a placeholder count that does not match the images names: messages, or a prompt request's prompt)."""
        limits = self.limits
        if len(parts) > limits.max_images:
            where = parts[limits.max_images][0]
            raise ImageError(f"{where}: a request may carry at most {limits.max_images} images "
                             f"(this one has {len(parts)})", where)
        found = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(found) != len(parts):
            raise ImageError(f"the prompt holds {len(found)} image placeholders ({self.image_token!r}) for "
                             f"{len(parts)} images; do not write the image token in text", prompt_param)
        tensors, out, last = [], [], 0
        for (where, url), pos in zip(parts, found):
            pixels = self.pixels(fetch_image(url, where, limits))
            out += ids[last:pos] + self.family.layout(self.config, pixels.shape, self.ids)
            last = pos + 1
            tensors.append(pack_tensor(pixels))
        return out + ids[last:], tensors


def load_vision_inputs(model_path: str, templater: Any, limits: ImageLimits) -> ImageInputs | None:
    """The tokenizer stage's image inputs for the served model (None: it takes text only), with the
    templater told what image parts render as, or why they are refused."""
    path = Path(model_path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    model_type = str(config.get("model_type", "")) or "unknown"
    inputs = load_image_inputs(path, limits) if family_of(config) is not None else None
    if inputs is None:
        templater.text_only = refusal_for_images(model_type)
    else:
        templater.image_token = inputs.image_token
    return inputs


def load_image_inputs(model_dir: Path, limits: ImageLimits) -> ImageInputs | None:
    """The image inputs of the checkpoint at `model_dir`, or None when its images are not served."""
    config = json.loads((model_dir / "config.json").read_text())
    family = family_of(config)
    if family is None:
        return None
    import importlib

    from mlx_vlm.utils import load_processor

    importlib.import_module(f"mlx_vlm.models.{family.name}")  # registers mlx-vlm's processor class
    processor = load_processor(model_dir, add_detokenizer=False)
    token = getattr(processor, "image_token", None) or "<image>"
    tok = processor.tokenizer
    specials = {name: int(tok.convert_tokens_to_ids(getattr(processor, f"image_{name}_token")))
                for name in family.specials}
    return ImageInputs(family, config, processor.image_processor, token, limits, specials)
