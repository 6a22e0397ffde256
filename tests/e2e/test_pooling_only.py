"""A pooling-only server through parallm-launch (issue 31): `--model` a reward model's directory (its task
read from its config: no --task) and the embedded all-MiniLM-L6-v2 beside it, no generator. The official
openai client lists both models and gets MiniLM's embeddings (its default, base64) equal to
sentence-transformers'; the reward model's /v1/rewards equal a direct forward; every generation route,
and a raw client's generation, answer 400 naming why; the raw client's pool() works."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from transformers import AutoTokenizer

from parallm.client import Client, ClientError
from parallm.protocol import SamplingParams
from tests._pooling_helpers import direct, write_decoder

from .server import Server

pytestmark = pytest.mark.e2e
DATA = Path(__file__).parent.parent / "data"


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return write_decoder(tmp_path_factory.mktemp("pooling-only") / "judge", "seqcls", seed=11)


@pytest.fixture(scope="module")
def srv(reward_model):
    with Server("--model", str(reward_model[0]), "--pooling-model", "minilm=default") as server:
        yield server


@pytest.fixture(scope="module")
def oai(srv):
    import openai

    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_the_ready_line_and_v1_models_name_the_pooling_models(srv, oai) -> None:
    assert "ready: model judge (reward, no generator)" in srv.output()
    assert [m.id for m in oai.models.list().data] == ["judge", "minilm"]


def test_openai_embeddings_equal_sentence_transformers(oai) -> None:
    """The client's default: base64 asked for, decoded by the client."""
    texts = json.loads((DATA / "minilm_texts.json").read_text())
    ref = np.load(DATA / "minilm_reference.npz")["embeddings"]
    got = np.array([d.embedding for d in oai.embeddings.create(model="minilm", input=texts).data], np.float32)
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert got.shape == (32, 384) and cos.min() >= 0.9999


def test_rewards_equal_a_direct_forward(srv, reward_model) -> None:
    path, model, score = reward_model
    texts = ["a fine answer", "Not so fine, perhaps."]
    body = httpx.post(f"{srv.url}/v1/rewards", json={"input": texts}, timeout=120).json()  # the only reward model
    tok = AutoTokenizer.from_pretrained(path)
    want = [float((direct(model, tok(t)["input_ids"]) @ score.T)[0]) for t in texts]
    assert body["model"] == "judge"
    assert np.allclose([d["reward"] for d in body["data"]], want, atol=1e-4)


def test_generation_answers_400_naming_why(srv, oai) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="judge", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_generative"
    assert "no text generator" in caught.value.message and "'judge' is a reward model" in caught.value.message
    for path in ("/v1/completions", "/v1/responses", "/generate", "/v1/load_lora_adapter"):
        r = httpx.post(f"{srv.url}{path}", json={"model": "judge", "prompt": "x"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative", (path, r.text)
    assert httpx.get(f"{srv.url}/health", timeout=30).json()["status"] == "ok"


def test_raw_client_pools_and_is_told_why_it_cannot_generate(srv) -> None:
    with Client(srv.router, timeout=120) as raw:
        with pytest.raises(ClientError) as caught:
            raw.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert caught.value.status == 400 and caught.value.code == "model_not_generative"
        assert "no text generator" in str(caught.value)
        vectors = raw.pool(["hello there"], "minilm")
        assert len(vectors) == 1 and len(vectors[0]) == 384
        assert abs(float(np.linalg.norm(vectors[0])) - 1.0) < 1e-5
        assert mx.array(raw.pool(["fine"], "judge", task="reward")).shape == (1, 1)
