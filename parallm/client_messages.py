"""The messages the raw clients send for a request or an adapter version: a Submit (token ids, straight to
the engine) or TextSubmit (text or chat, through a tokenizer), and an AdapterPublish (parallm/client.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import protocol
from .protocol import SamplingParams

Prompt = Sequence[int] | str | list[dict[str, Any]]


def request_message(rid: str, prompt: Prompt, params: SamplingParams | None, n: int, detok: bool,
                    spec: Mapping[str, Any]) -> protocol.Submit | protocol.TextSubmit:
    """The Submit (token ids, straight to the engine) or TextSubmit (text or chat, through a tokenizer)
    for a prompt; `spec` holds other RequestSpec fields (adapter, priority, metadata, ...) and
    `detok_options` (DetokSpec fields)."""
    fields = dict(spec)
    detok_options = fields.pop("detok_options", {})
    images = _images(fields.pop("images", None), fields.pop("multi_modal_data", None))
    allowed = [f for f in protocol.RequestSpec.__struct_fields__ if f not in ("params", "n", "detok")]
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise TypeError(f"unknown request field(s) {', '.join(unknown)}; a request also takes {', '.join(allowed)} "
                        "and detok_options")
    request = protocol.RequestSpec(params=params or SamplingParams(), n=n,
                                   detok=protocol.DetokSpec(**detok_options) if detok else None,
                                   submitted_at=fields.pop("submitted_at", 0.0) or time.time(), **fields)
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict)):
        text = {"prompt": prompt} if isinstance(prompt, str) else {"messages": list(prompt)}
        return protocol.TextSubmit(rid=str(rid), reply_to=b"", spec=request, images=images, **text)
    if not len(prompt):
        raise ValueError("the prompt is empty")
    if images:  # token ids with one image token per image: the tokenizer fetches, processes and expands them
        return protocol.TextSubmit(rid=str(rid), reply_to=b"", spec=request, prompt_ids=protocol.pack_ids(prompt),
                                   images=images)
    return protocol.Submit(rid=str(rid), reply_to=b"", prompt_ids=protocol.pack_ids(prompt), spec=request)


def _images(images: Any, multi_modal_data: Mapping[str, Any] | None) -> list[str]:
    """A request's images as URLs, from `images=[...]` or vLLM's `multi_modal_data={"image": x or [x, ...]}`
    (data:/http(s) URLs, bytes of image files, or base64 text)."""
    from .vision.inputs import as_image_url

    if multi_modal_data is not None:
        unknown = sorted(set(multi_modal_data) - {"image"})
        if unknown:
            raise TypeError(f"multi_modal_data holds {', '.join(unknown)}; this server takes images only")
        if images is not None:
            raise TypeError("give images or multi_modal_data, not both")
        images = multi_modal_data.get("image")
    if images is None:
        return []
    items = images if isinstance(images, (list, tuple)) else [images]
    return [as_image_url(x) for x in items]


def adapter_message(name: str, version: int, weights: Any, config: Mapping[str, Any] | None, format: str,
                    make_default: bool) -> protocol.AdapterPublish:
    """The AdapterPublish a trainer publishes (see training/publisher.py), for the engine's PULL socket.
    `weights`: safetensors bytes, a path the engine can read, or tensors by name."""
    path, blob = "", b""
    if isinstance(weights, (str, Path)):
        path = str(weights)
    elif isinstance(weights, (bytes, bytearray)):
        blob = bytes(weights)
    else:
        from .adapters import save_bytes

        blob = save_bytes(dict(weights))
    return protocol.AdapterPublish(name=name, version=int(version), config=dict(config or {}), weights=blob,
                                   path=path, format=format, make_default=make_default)  # type: ignore[arg-type]
