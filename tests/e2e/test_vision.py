"""Image input end to end: parallm-launch serving a tiny random-weight LLaVA (and, in the slow tier, Pixtral;
tests/_vision_helpers.py), the official openai client sending base64 images (one, two, beside a text-only
request) in chat messages and as the Responses API's input_image parts (also an http URL of an allowed
local host), and the error cases; the served greedy tokens equal mlx-vlm's own generate loop on the same ids
and pixels, and a Responses answer equals the chat answer to the same images and text."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io

import openai
import pytest

from tests._vision_helpers import data_url, image_site, png, reference_tokens, write_vlm

from .server import Server

pytestmark = pytest.mark.e2e
MAX = 6
servers: dict = {}  # the module's server by model directory (the raw and RL clients need its addresses)


MAX_BYTES = 400_000


@pytest.fixture(scope="module")
def site():
    """A local HTTP server of images; the vision server may fetch from 127.0.0.1."""
    with image_site() as url:
        yield url


@pytest.fixture(scope="module", params=["llava", pytest.param("pixtral", marks=pytest.mark.slow)])
def vlm(request, tmp_path_factory):
    path = write_vlm(tmp_path_factory.mktemp("vlm") / f"tiny-{request.param}", request.param)
    with Server("--model", str(path), "--engine.max-num-seqs", "8", "--tokenizer.max-images", "2",
                "--tokenizer.max-image-pixels", str(256 * 256), "--tokenizer.max-image-bytes", str(MAX_BYTES),
                "--tokenizer.image-fetch-hosts", "127.0.0.1", "--tokenizer.image-fetch-timeout-s", "5") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        servers[path] = srv
        yield path, client, client.models.list().data[0].id


def user(*images: bytes, text: str = "What is in this picture?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def chat(client, name, messages, **kw):
    return client.chat.completions.create(model=name, messages=messages, max_tokens=MAX, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)


def pixels_of(path, images: list[bytes]):
    from PIL import Image

    from parallm.vision.fetch import ImageLimits
    from parallm.vision.inputs import load_image_inputs

    inputs = load_image_inputs(path, ImageLimits())
    return [inputs.pixels(Image.open(io.BytesIO(d)).convert("RGB")) for d in images]


def test_one_and_two_images_match_mlx_vlm_beside_a_text_request(vlm):
    path, client, name = vlm
    one, two = png(11), [png(12), png(13)]  # one size: the reference stacks them unpadded
    with cf.ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(chat, client, name, user(one)), pool.submit(chat, client, name, user(*two, text="Compare.")),
                pool.submit(chat, client, name, [{"role": "user", "content": "Only text."}])]
        outs = [j.result() for j in jobs]
    for out, images in zip(outs, ([one], two, [])):
        prompt, tokens = out.model_extra.get("prompt_token_ids"), out.choices[0].model_extra["token_ids"]
        assert prompt, "return_token_ids gives the prompt's ids"
        assert tokens == reference_tokens(path, prompt, pixels_of(path, images), MAX)
        assert out.usage.prompt_tokens == len(prompt)
    assert outs[0].usage.prompt_tokens > outs[2].usage.prompt_tokens  # 16 image tokens per image


def test_streamed_image_request(vlm):
    _, client, name = vlm
    stream = client.chat.completions.create(model=name, messages=user(png(14)), max_tokens=MAX, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text


@pytest.mark.parametrize("content, param, words", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!notbase64"}}],
     "messages[0].content[0].image_url", "not valid base64"),
    ([{"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}],
     "messages[0].content[0].image_url", "could not be decoded"),
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
     "messages[0].content[1].image_url", "not allowed"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
     "messages[0].content[0].image_url", "data: or http(s)"),
    ([{"type": "image_url", "image_url": {"url": data_url(png(1, (300, 300)))}}],
     "messages[0].content[0].image_url", "more than the 65536"),
    ([{"type": "image_url", "image_url": {"url": data_url(png(1))}}] * 3,
     "messages[0].content[2]", "at most 2 images"),
    ([{"type": "text", "text": "IMAGE_TOKEN sneaked in"}, {"type": "image_url", "image_url": {"url": data_url(png(1))}}],
     "messages", "image placeholders"),
])
def test_bad_images_are_400_naming_the_part(vlm, content, param, words):
    path, client, name = vlm
    token = "[IMG]" if "pixtral" in path.name else "<image>"
    content = [{**p, "text": p["text"].replace("IMAGE_TOKEN", token)} if p["type"] == "text" else p for p in content]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, name, [{"role": "user", "content": content}])
    body = err.value.body
    assert body["param"] == param and words in body["message"], body


def test_decompression_bomb_is_a_400(vlm):
    """A PNG whose header claims 20000 x 20000 pixels, a few kB on the wire."""
    from PIL import Image

    _, client, name = vlm
    image = Image.new("1", (20000, 20000))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, name, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}]}])
    assert "more pixels than the 65536" in err.value.body["message"]
    assert err.value.body["param"] == "messages[0].content[0].image_url"


def token(path) -> str:
    return "[IMG]" if "pixtral" in path.name else "<image>"


def test_raw_client_and_rl_generate_shapes_take_images(vlm):
    """The raw ZeroMQ client (token ids with one image token, vLLM's multi_modal_data), TRL's /generate
    `images` (base64 without a prefix), vLLM's /generate TokensPrompt multi_modal_data and SGLang's
    `image_data`: the same image and prompt give the tokens mlx-vlm gives; a bad image is named as sent."""
    import httpx

    from parallm.client import Client
    from parallm.protocol import SamplingParams
    from transformers import AutoTokenizer

    path, _, _ = vlm
    srv = servers[path]
    image = png(31)
    text = "<|im_start|>user\n" + token(path) + "What?<|im_end|>\n<|im_start|>assistant\n"
    ids = AutoTokenizer.from_pretrained(str(path), local_files_only=True).encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True)
    with Client(srv.router, timeout=120) as raw:
        by_ids = raw.generate(ids, params, multi_modal_data={"image": image})[0]
        by_text = raw.generate(text, params, images=[data_url(image)])[0]
    sampling = {"temperature": 0, "max_tokens": MAX, "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        b64 = base64.b64encode(image).decode()
        trl = http.post("/generate", json={"prompts": [text], "images": [b64], **sampling}).json()
        vllm = http.post("/generate", json={"prompt": {"prompt_token_ids": ids, "multi_modal_data": {"image": data_url(image)}},
                                            "logprobs": 0, **sampling})
        bad = http.post("/generate", json={"prompts": [text], "images": ["bm90IGFuIGltYWdl"], **sampling})
        two = text.replace("What?", token(path) + "What?")
        sglang = {"temperature": 0, "max_new_tokens": MAX, "ignore_eos": True}
        refusals = [http.post("/generate", json={**body, **({} if "sampling_params" in body else sampling)})
                    for body in (
            {"prompts": [text, text], "images": [b64, "bm90IGFuIGltYWdl"]},
            {"prompts": [two], "images": [[b64, "bm90IGFuIGltYWdl"]]},
            {"prompts": [text, "No image token here."], "images": [b64, b64]},
            # (prompt[0] must be valid: an image token without an image would be a second error, whose
            # engine-side refusal can reach ingress first: a race that the stage's idle check used to decide)
            {"prompt": ["No image token here.", {"prompt_token_ids": ids,
                                                 "multi_modal_data": {"image": data_url(b"no image")}}]},
            {"text": [text, two], "image_data": [b64, [b64, "bm90IGFuIGltYWdl"]], "sampling_params": sglang},
            {"input_ids": ids, "image_data": [b64, b64], "sampling_params": sglang},
        )]
        sglang_out = http.post("/generate", json={"input_ids": ids, "image_data": data_url(image),
                                                  "sampling_params": sglang}).json()
    assert vllm.status_code == 200, vllm.text
    want = reference_tokens(path, trl["prompt_ids"][0], pixels_of(path, [image]), MAX)
    assert trl["completion_ids"][0] == want
    assert by_ids.token_ids == want and by_text.token_ids == want
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "images[0]", bad.text
    # a bad image of a later prompt, or inside a prompt's list, is named as the request holds it
    assert sglang_out["output_ids"] == want, sglang_out
    for r, param in zip(refusals, ["images[1]", "images[0][1]", "prompts[1]", "prompt[1].multi_modal_data.image",
                                   "image_data[1][1]", "input_ids"]):
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, r.text
        assert param in error["message"] or "placeholders" in error["message"], r.text


# --------------------------------------------------------------------------- the Responses API

def respond(client, name, content: list[dict], **kw):
    return client.responses.create(model=name, input=[{"role": "user", "content": content}], max_output_tokens=MAX,
                                   temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_responses_input_images_answer_as_chat_does(vlm, site):
    """input_image parts (a base64 data: URL; two images, one of them an http URL of an allowed host) give the
    chat route's greedy answer to the same images and text; streamed, stored, listed and continued."""
    _, client, name = vlm
    cases = [[{"type": "input_image", "image_url": data_url(png(11)), "detail": "auto"},
              {"type": "input_text", "text": "What is in this picture?"}],
             [{"type": "input_text", "text": "Compare"}, {"type": "input_image", "image_url": f"{site}/12.png"},
              {"type": "input_text", "text": "with"}, {"type": "input_image", "image_url": data_url(png(13)),
                                                       "detail": "low"}]]
    for content in cases:
        answer = respond(client, name, content)
        same = chat(client, name, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": p["image_url"]}} if p["type"] == "input_image" else
            {"type": "text", "text": p["text"]} for p in content]}])
        assert answer.output_text == same.choices[0].message.content and answer.output_text
        assert answer.incomplete_details.reason == "max_output_tokens" == {"length": "max_output_tokens"}[
            same.choices[0].finish_reason]  # ignore_eos: MAX tokens
        assert answer.usage.input_tokens == same.usage.prompt_tokens > 32  # 16 image tokens per image (LLaVA)
    events = list(respond(client, name, content, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == answer.output_text
    items = client.responses.input_items.list(answer.id, order="asc").data
    assert [p.type for p in items[0].content] == ["input_text", "input_image", "input_text", "input_image"]
    assert items[0].content[1].image_url == f"{site}/12.png" and items[0].content[3].detail == "low"
    more = client.responses.create(model=name, previous_response_id=answer.id, input="And now?", max_output_tokens=MAX,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert more.output_text and more.usage.input_tokens > answer.usage.input_tokens  # the images again


@pytest.mark.parametrize("part, param, words", [
    ({"type": "input_image", "image_url": data_url(b"not an image at all")}, "input[0].content[1].image_url",
     "could not be decoded"),
    ({"type": "input_image", "image_url": "data:image/png;base64,!!!notbase64"}, "input[0].content[1].image_url",
     "not valid base64"),
    ({"type": "input_image", "image_url": data_url(b"\0" * (MAX_BYTES + 1))}, "input[0].content[1].image_url",
     f"larger than {MAX_BYTES} bytes"),
    ({"type": "input_image", "image_url": data_url(png(1, (300, 300)))}, "input[0].content[1].image_url",
     "more than the 65536"),
    ({"type": "input_image", "image_url": "SITE/missing.png"}, "input[0].content[1].image_url",
     "could not be fetched"),
    ({"type": "input_image", "image_url": "http://127.0.0.1:9/cat.png"}, "input[0].content[1].image_url",
     "could not be fetched"),  # nothing listens on port 9 (discard)
    ({"type": "input_image", "image_url": "https://example.com/cat.png"}, "input[0].content[1].image_url",
     "not allowed"),
    ({"type": "input_image", "file_id": "file-abc123"}, "input[0].content[1].file_id", "file_id"),
    ({"type": "input_image", "image_url": data_url(png(1)), "detail": "huge"}, "input[0].content[1].detail",
     "detail"),
    ({"type": "input_file", "file_data": "x"}, "input[0].content[1].type", "input_file"),
])
def test_responses_bad_images_are_400_naming_the_part(vlm, site, part, param, words):
    _, client, name = vlm
    part = {k: v.replace("SITE", site) if isinstance(v, str) else v for k, v in part.items()}
    with pytest.raises(openai.BadRequestError) as err:
        respond(client, name, [{"type": "input_text", "text": "What?"}, part])
    body = err.value.body
    assert body["param"] == param and words in body["message"] and param.split(".")[0] in body["message"], body


def test_responses_too_many_images_name_the_first_part_over(vlm):
    _, client, name = vlm
    with pytest.raises(openai.BadRequestError) as err:
        respond(client, name, [{"type": "input_image", "image_url": data_url(png(1))}] * 3, instructions="Be brief.")
    assert err.value.body["param"] == "input[0].content[2]" and "at most 2 images" in err.value.body["message"]
