"""The vision tests' helpers: the tiny checkpoints (parallm/models/tiny_vlm.py, shared with perf/bench_vision),
mlx-vlm's own greedy generation as the reference, and a local HTTP server of images (remote image URLs)."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np

from parallm.models.tiny_vlm import (FAMILIES, IMAGE_SIZE, IMAGE_TOKEN, PATCH, PIXTRAL_EDGE, PIXTRAL_TOKENS,  # noqa: F401
                                 data_url, png, write_vlm)


def reference_tokens(path: Path, prompt_ids: list[int], pixels: list[np.ndarray], max_tokens: int) -> list[int]:
    """mlx-vlm's own greedy generation (its model class, weights loader and generate_step) for the prompt
    ids (one run of image tokens per image) and the images' pixel values (one [C, H, W] array each).
    mlx-vlm 0.7.10's LlavaProcessor cannot run under transformers 5.24 (it passes `padding` to the
    PIL image processor, which refuses it), so the prompt is processed by the caller, as parallm does."""
    from mlx_vlm import load
    from mlx_vlm.generate import generate_step

    model, _ = load(str(path))
    values = mx.array(np.stack(pixels)) if pixels else None
    out = []
    for token, _ in generate_step(mx.array([prompt_ids]), model, values, None, max_tokens=max_tokens,
                                  temperature=0.0):
        out.append(int(token))
        if len(out) == max_tokens:
            break
    return out


class _ImageSite(http.server.BaseHTTPRequestHandler):
    """GET /<seed>.png: png(seed) (any other name: png(1)); /slow.png answers after 2 s, /big.png is
    5,000 bytes that are no image, /missing.png is a 404."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/slow.png":
            time.sleep(2)
        name = self.path.strip("/").removesuffix(".png")
        body = b"\0" * 5000 if name == "big" else png(int(name) if name.isdigit() else 1)
        self.send_response(404 if name == "missing" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:  # the client timed out (slow.png)
            pass

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def image_site() -> Iterator[str]:
    """A local HTTP server of images on 127.0.0.1 (its base URL) for as long as the context lasts."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageSite)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
