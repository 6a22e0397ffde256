"""End to end: parallm-launch on tiny random-weight model directories of a mixture-of-experts and
a hybrid (gated delta-net + attention) model (built like perf/bench_gpu.py's shapes, with the
default model's tokenizer) answers the official openai client, greedy tokens equal to mlx-lm's
own decoding of the same directory."""

from __future__ import annotations

import openai
import pytest

from .server import Server

pytestmark = pytest.mark.e2e

PROMPT = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-hybrid"])
def model_dir(request, tmp_path_factory):
    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer, materialize
    from perf.bench_gpu import build_model_dir

    default = load_model(ModelConfig())
    vocab = len(load_tokenizer(default.source))
    return build_model_dir(request.param, tmp_path_factory.mktemp("shape") / request.param,
                           materialize(default.source, "float32"), vocab_size=vocab)


def test_tiny_model_served_to_the_openai_client(model_dir):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)]
    with Server("--model", str(model_dir), "--engine.max-num-seqs", "8") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == want
        assert out.usage.completion_tokens == 8
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
