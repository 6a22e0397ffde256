"""Image input in the engine, on tiny random-weight LLaVA and Pixtral models built from mlx-vlm's own config classes:
served greedy tokens equal mlx-vlm's own generate loop for image+text prompts, batched with text-only
requests; the prefix cache keys image tokens by the image's content."""

from __future__ import annotations

import io

import numpy as np
import pytest

from _engine_helpers import greedy, run_all
from _vision_helpers import FAMILIES, data_url, png, reference_tokens, write_vlm
from parallm.config import AdaptersConfig, Config, EngineConfig, ModelConfig
from parallm.engine import Engine, EngineModel, Request, RequestRejected
from parallm.models.loader import load_model
from parallm.protocol import RequestSpec, unpack_tensor
from parallm.vision.fetch import ImageLimits
from parallm.vision.inputs import load_image_inputs

MAX = 8


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory):
    path = write_vlm(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}", request.param)
    loaded = load_model(ModelConfig(path=str(path)))
    inputs = load_image_inputs(path, ImageLimits())
    from transformers import AutoTokenizer

    inputs.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return path, loaded, inputs


def engine_of(loaded, **engine) -> Engine:
    config = Config(engine=EngineConfig(kv_budget_mb=64, **engine), adapters=AdaptersConfig(merge_mb=0))
    return Engine(EngineModel.of(loaded), config)


def prompt(inputs, text: str, images: list[bytes]) -> tuple[list[int], list[np.ndarray]]:
    """The ids and pixels the tokenizer stage makes for a user turn with `images` before `text`: one
    image token per image in the rendered chat, expanded by ImageInputs.prepare."""
    rendered = "<|im_start|>user\n" + inputs.image_token * len(images) + text + "<|im_end|>\n<|im_start|>assistant\n"
    ids = inputs.tokenizer.encode(rendered)
    parts = [(f"messages[0].content[{i}]", data_url(data)) for i, data in enumerate(images)]
    ids, tensors = inputs.prepare(ids, parts)
    return ids, [unpack_tensor(t) for t in tensors]


def test_image_prompts_match_mlx_vlm_generate_batched_with_text(vlm):
    path, loaded, inputs = vlm
    a_ids, a_px = prompt(inputs, "What is in this picture?", [png(1)])
    b_ids, b_px = prompt(inputs, "Describe it.", [png(2, (64, 48))])
    two_ids, two_px = prompt(inputs, "Compare them.", [png(3), png(4)])
    text_ids, _ = prompt(inputs, "No image here, just text.", [])
    engine = engine_of(loaded)
    out = run_all(engine, [Request("a", a_ids, RequestSpec(params=greedy(MAX)), a_px),
                           Request("text", text_ids, RequestSpec(params=greedy(MAX))),
                           Request("b", b_ids, RequestSpec(params=greedy(MAX)), b_px),
                           Request("two", two_ids, RequestSpec(params=greedy(MAX)), two_px)])
    for rid, ids, px in (("a", a_ids, a_px), ("b", b_ids, b_px), ("two", two_ids, two_px), ("text", text_ids, [])):
        assert out[(rid, 0)]["tokens"] == reference_tokens(path, ids, px, MAX), rid
    assert out[("a", 0)]["tokens"] != out[("b", 0)]["tokens"]


def test_same_image_reuses_blocks_and_a_different_image_does_not(vlm):
    _, loaded, inputs = vlm
    ids, px = prompt(inputs, "What is in this picture? " * 3, [png(5)])
    _, other = prompt(inputs, "What is in this picture? " * 3, [png(6)])
    engine = engine_of(loaded, block_size=8)
    first = run_all(engine, [Request("1", ids, RequestSpec(params=greedy(4)), px)])
    again = run_all(engine, [Request("2", ids, RequestSpec(params=greedy(4)), px)])
    swapped = run_all(engine, [Request("3", ids, RequestSpec(params=greedy(4)), other)])
    image_at = ids.index(inputs.image_token_id)
    assert first[("1", 0)]["usage"].cached_tokens == 0
    assert again[("2", 0)]["usage"].cached_tokens >= len(ids) - 8  # every full block but the last token's
    assert again[("2", 0)]["tokens"] == first[("1", 0)]["tokens"]
    cached = swapped[("3", 0)]["usage"].cached_tokens
    assert cached <= image_at  # only the text blocks before the image are shared
    fresh = run_all(engine_of(loaded), [Request("4", ids, RequestSpec(params=greedy(4)), other)])
    assert swapped[("3", 0)]["tokens"] == fresh[("4", 0)]["tokens"]
    engine.check_integrity()


def test_image_runs_must_fit_the_images(vlm):
    _, loaded, inputs = vlm
    ids, px = prompt(inputs, "hi", [png(7)])
    engine = engine_of(loaded)
    with pytest.raises(RequestRejected, match="image tokens"):
        engine.add_request(Request("x", ids, RequestSpec(params=greedy(2)), px + px))
    with pytest.raises(RequestRejected, match="no images"):
        engine.add_request(Request("y", ids, RequestSpec(params=greedy(2))))
    with pytest.raises(RequestRejected, match="images\\[0\\]"):
        engine.add_request(Request("z", ids, RequestSpec(params=greedy(2)), [np.full((3, 32, 32), np.nan, np.float32)]))


def test_pixtral_prompt_ids_are_mlx_vlm_processors(tmp_path):
    """Pixtral's image-token grid ([IMG] rows, [IMG_BREAK], [IMG_END]) as mlx-vlm's PixtralProcessor writes it,
    and its generate (processor included) gives the served model's tokens."""
    from PIL import Image
    from mlx_vlm import load, stream_generate

    path = write_vlm(tmp_path / "pix", "pixtral", seed=1)
    inputs = load_image_inputs(path, ImageLimits())
    from transformers import AutoTokenizer

    inputs.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    image = png(21, (45, 20))
    ids, px = prompt(inputs, "What?", [image])
    model, processor = load(str(path))
    rendered = "<|im_start|>user\n[IMG]What?<|im_end|>\n<|im_start|>assistant\n"
    theirs = processor(text=[rendered], images=[Image.open(io.BytesIO(image)).convert("RGB")])
    assert np.asarray(theirs["input_ids"]).reshape(-1).tolist() == ids
    (tmp_path / "i.png").write_bytes(image)
    want = [r.token for r in stream_generate(model, processor, rendered, image=[str(tmp_path / "i.png")],
                                             max_tokens=MAX, temperature=0.0)][:MAX]
    out = run_all(engine_of(load_model(ModelConfig(path=str(path)))),
                  [Request("p", ids, RequestSpec(params=greedy(MAX)), px)])
    assert out[("p", 0)]["tokens"] == want
