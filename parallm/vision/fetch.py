"""Image parts to decoded images, bounded in bytes, pixels and time (the tokenizer stage runs this).

An image part is OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (or vLLM's and the
Responses API's `{"type": "input_image", "image_url": "..."}`). A data: URL is decoded in place; an
http(s) URL is fetched only when its host is on `tokenizer.image_fetch_hosts` (empty by default), with a
byte cap and a timeout. Pillow reads the header first: more than `max_image_pixels` is refused before the
pixels are decoded (a decompression bomb is a 400, not an out-of-memory). Every failure is an
ImageError naming the part."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["ImageError", "ImageLimits", "IMAGE_PART_TYPES", "image_url_of", "fetch_image", "decode_image"]

IMAGE_PART_TYPES = ("image_url", "input_image", "image")


class ImageError(ValueError):
    """An image part the server refuses: a message for the client and the part it names."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_images: int = 8
    max_bytes: int = 20 * 2**20
    max_pixels: int = 6000 * 6000
    fetch_hosts: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0

    @classmethod
    def of(cls, tokenizer_config: Any) -> "ImageLimits":
        c = tokenizer_config
        return cls(c.max_images, c.max_image_bytes, c.max_image_pixels,
                   tuple(h.lower() for h in c.image_fetch_hosts), c.image_fetch_timeout_s)


def _param(where: str) -> str:
    """The parameter an error names: a chat part's image_url, or a prompt request's images[i] itself."""
    return where if where.startswith("images[") else f"{where}.image_url"


def image_url_of(part: dict, where: str) -> str:
    """The URL of an image part; ImageError when it has none."""
    url = part.get("image_url", part.get("image"))
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where} has no image URL (give image_url.url, a data: or http(s) URL)", f"{where}.image_url")
    return url


def fetch_image(url: str, where: str, limits: ImageLimits) -> Any:
    """The decoded RGB PIL image at `url`."""
    return decode_image(_bytes_of(url, where, limits), where, limits)


def _bytes_of(url: str, where: str, limits: ImageLimits) -> bytes:
    param = _param(where)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep:
            raise ImageError(f"{where}: the data: URL has no ',' before its data", param)
        if len(payload) > limits.max_bytes * 4 // 3 + 4:
            raise ImageError(f"{where}: the image is larger than {limits.max_bytes} bytes", param)
        if head.endswith(";base64"):
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ImageError(f"{where}: the data: URL is not valid base64", param) from None
        return urllib.parse.unquote_to_bytes(payload)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ImageError(f"{where}: image URLs must be data: or http(s) URLs (got {scheme or 'none'!r})", param)
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in limits.fetch_hosts:
        raise ImageError(f"{where}: fetching images from {host or 'this URL'} is not allowed on this server "
                         "(send the image inline as a data: URL, or allow the host with "
                         "--tokenizer.image-fetch-hosts)", param)
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as response:  # noqa: S310 - allow-listed
            data = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ImageError(f"{where}: the image URL could not be fetched: {exc}", param) from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: the image is larger than {limits.max_bytes} bytes", param)
    return data


def decode_image(data: bytes, where: str, limits: ImageLimits) -> Any:
    """Bytes of an image file, decoded to RGB; refused when larger than the byte or pixel limits or not an image."""
    from PIL import Image, UnidentifiedImageError

    param = _param(where)
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: the image is larger than {limits.max_bytes} bytes", param)
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own guard (twice its MAX_IMAGE_PIXELS), before ours
        raise ImageError(f"{where}: the image has more pixels than the {limits.max_pixels} this server decodes",
                         param) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError(f"{where}: the image could not be decoded (not an image file Pillow reads)", param) from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(f"{where}: the image has {width}x{height} pixels, more than the {limits.max_pixels} "
                         "this server decodes", param)
    if width < 1 or height < 1:
        raise ImageError(f"{where}: the image is empty", param)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise ImageError(f"{where}: the image could not be decoded (truncated or corrupt)", param) from None
