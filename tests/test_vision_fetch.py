"""Image parts to decoded images (parallm/vision/fetch.py): data: URLs, http(s) URLs only from allowed
hosts (a real local HTTP server: size cap, timeout, unreachable), bounds in bytes and pixels; the wire
tensors (protocol/tensors.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from _vision_helpers import data_url, image_site, png
from parallm import protocol
from parallm.vision.fetch import ImageError, ImageLimits, decode_image, fetch_image, image_url_of
from parallm.vision.inputs import image_parts

W = "messages[0].content[1]"


@pytest.fixture(scope="module")
def site():
    with image_site() as url:
        yield url


def refused(url: str, limits: ImageLimits = ImageLimits()) -> ImageError:
    with pytest.raises(ImageError) as err:
        fetch_image(url, W, limits)
    assert err.value.param == f"{W}.image_url" and err.value.status == 400
    return err.value


def test_data_urls_decode_to_rgb():
    image = fetch_image(data_url(png(3, (20, 10))), W, ImageLimits())
    assert image.size == (20, 10) and image.mode == "RGB"
    assert "not valid base64" in refused("data:image/png;base64,@@@").message
    assert "no ','" in refused("data:image/png;base64").message
    assert "could not be decoded" in refused(data_url(b"GIF89a but not really")).message
    truncated = png(4, (64, 64))[:200]
    assert "could not be decoded" in refused(data_url(truncated)).message


def test_bytes_and_pixels_are_bounded_before_decoding():
    big = png(5, (100, 100))
    assert "larger than 100 bytes" in refused(data_url(big), ImageLimits(max_bytes=100)).message
    assert "100x100 pixels, more than the 5000" in refused(data_url(big), ImageLimits(max_pixels=5000)).message
    from PIL import Image

    bomb = io.BytesIO()
    Image.new("1", (14000, 14000)).save(bomb, format="PNG")  # ~30 kB claiming 196 M pixels
    assert "more pixels than" in refused(data_url(bomb.getvalue())).message


def test_remote_urls_only_from_allowed_hosts(site):
    assert "not allowed" in refused(f"{site}/ok.png").message  # off by default
    allowed = ImageLimits(fetch_hosts=("127.0.0.1",), fetch_timeout_s=0.5, max_bytes=4000)
    assert fetch_image(f"{site}/ok.png", W, allowed).size == (40, 30)
    assert "could not be fetched" in refused(f"{site}/missing.png", allowed).message
    assert "could not be fetched" in refused(f"{site}/slow.png", allowed).message  # the timeout
    assert "larger than 4000 bytes" in refused(f"{site}/big.png", allowed).message
    assert "data: or http(s)" in refused("ftp://127.0.0.1/x.png", allowed).message
    closed = ImageLimits(fetch_hosts=("localhost",), fetch_timeout_s=0.5)
    assert "could not be fetched" in refused("http://localhost:9/x.png", closed).message  # nothing listens


def test_image_parts_name_their_place():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "data:x,1"}},
                                             {"type": "input_image", "image_url": "data:x,2"}]}]
    assert image_parts(messages) == [("messages[1].content[1]", "data:x,1"), ("messages[1].content[2]", "data:x,2")]
    with pytest.raises(ImageError) as err:
        image_url_of({"type": "image_url", "image_url": {}}, W)
    assert err.value.param == f"{W}.image_url"


def test_tensors_round_trip_and_refuse_bad_bytes():
    a = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    t = protocol.pack_tensor(a)
    back = protocol.decode(protocol.encode(protocol.Submit(rid="r", reply_to=b"", prompt_ids=b"", images=[t])))
    assert np.array_equal(protocol.unpack_tensor(back.images[0]), a)
    with pytest.raises(ValueError, match="cannot hold"):
        protocol.unpack_tensor(protocol.Tensor(data=b"\0" * 7, dtype="float32", shape=[2]))
    with pytest.raises(ValueError, match="not a shape"):
        protocol.unpack_tensor(protocol.Tensor(data=b"", dtype="float32", shape=[-1]))
    assert base64.b64encode(b"x")  # (the data: URLs above are base64)
