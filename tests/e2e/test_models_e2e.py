"""End to end: parallm-launch on tiny random-weight model directories of a mixture-of-experts and
a hybrid (gated delta-net + attention) model (built like perf/bench_gpu.py's shapes, with the
default model's tokenizer) answers the official openai client, greedy tokens equal to mlx-lm's
own decoding of the same directory; an OpenAI request without sampling fields follows the
directory's generation_config.json (a raw client's does not); on the MoE, a LoRA on the experts loaded over /v1/adapters gives mlx-lm's
own LoRA model's tokens."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 32 s, two servers: make test's 10-minute budget (clean clone, 2-core CI host)

PROMPT = [1, 504, 3458, 282, 4649, 314]
GENERATION_DEFAULTS = {"temperature": 0.0, "top_k": 1, "max_new_tokens": 5}


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-hybrid"])
def model_dir(request, tmp_path_factory):
    from parallm.config import ModelConfig
    from parallm.models import load_model, load_tokenizer, materialize
    from parallm.models.shapes import build_model_dir

    default = load_model(ModelConfig())
    vocab = len(load_tokenizer(default.source))
    out = build_model_dir(request.param, tmp_path_factory.mktemp("shape") / request.param,
                          materialize(default.source, "float32"), vocab_size=vocab)
    gen = out / "generation_config.json"  # sampling defaults the OpenAI routes apply (vLLM's --generation-config)
    gen.write_text(json.dumps({**(json.loads(gen.read_text()) if gen.exists() else {}), **GENERATION_DEFAULTS}))
    return out


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
        # no sampling fields, no max_tokens: the directory's generation_config.json decides (greedy, 5 tokens)
        out = client.completions.create(model=name, prompt=PROMPT, extra_body={"ignore_eos": True,
                                                                               "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == want[:5]
        # a raw client gets exactly the parameters it sends: the protocol's max_tokens (16), not the file's 5
        from parallm.client import Client
        from parallm.protocol import SamplingParams

        with Client(srv.router, timeout=120) as raw:
            [seq] = raw.generate(PROMPT, SamplingParams(ignore_eos=True, seed=1))
        assert len(seq.token_ids) == SamplingParams().max_tokens != 5
        if model_dir.name == "tiny-moe":  # LoRA on the experts, loaded over HTTP (/v1/adapters)
            adapter = _expert_lora(model_dir, model_dir / "adapters" / "experts")
            r = httpx.post(f"{srv.url}/v1/adapters", json={"name": "experts", "path": str(adapter[0])}, timeout=60)
            assert r.status_code == 200, r.text
            out = client.completions.create(model="experts", prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].model_extra["token_ids"] == adapter[1] != want
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6


def _expert_lora(model_dir, out):
    """An mlx-lm LoRA on every expert projection of the directory's model, saved as mlx-lm saves it,
    and mlx-lm's own greedy tokens under it."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from tests._adapter_helpers import lora_model, save_mlx

    model, _ = load_model(model_dir)
    config = lora_model(model, keys=("mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj"),
                        rank=4, spread=0.3)
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)]
    return save_mlx(model, config, out), want
