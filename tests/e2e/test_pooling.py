"""Pooling models served beside the generator (issue 31), on the session server: the official openai
client's embeddings.create (float and base64) against sentence-transformers' reference vectors,
`dimensions`, a reward model and a decoder embedding model against a direct forward, classification,
the raw ZeroMQ client, and the errors."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from parallm.client import ClientError
from parallm.training.reward_model import WithRewardModel
from parallm.training.tasks import load_task
from tests._pooling_helpers import direct

pytestmark = pytest.mark.e2e
DATA = Path(__file__).parent.parent / "data"


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_openai_embeddings_equal_sentence_transformers(openai_client, encoding: str) -> None:
    texts = json.loads((DATA / "minilm_texts.json").read_text())
    ref = np.load(DATA / "minilm_reference.npz")["embeddings"]
    r = openai_client.embeddings.create(model="minilm", input=texts, encoding_format=encoding)
    # asked for base64 explicitly, the client hands the string over as it came (little-endian float32)
    got = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") if encoding == "base64" else d.embedding
                    for d in r.data], np.float32)
    assert [d.index for d in r.data] == list(range(32)) and got.shape == (32, 384)
    assert _cos(got, ref).min() >= 0.9999
    lengths = np.load(DATA / "minilm_reference.npz")["lengths"]
    assert r.usage.prompt_tokens == r.usage.total_tokens == int(lengths.sum())


def test_openai_default_encoding_and_token_ids(openai_client, http) -> None:
    """The openai client asks for base64 by default and decodes it; token ids are embedded as given."""
    text = "The quick brown fox jumps over the lazy dog."
    by_text = np.array(openai_client.embeddings.create(model="minilm", input=text).data[0].embedding)
    ids = [101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 1012, 102]
    by_ids = np.array(http.post("/v1/embeddings", json={"model": "minilm", "input": ids}).json()["data"][0]["embedding"])
    assert _cos(by_text, by_ids) > 0.99999


def test_dimensions(http, openai_client) -> None:
    r = http.post("/v1/embeddings", json={"model": "minilm", "input": "x", "dimensions": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert "Matryoshka" in r.json()["error"]["message"]
    full = np.array(openai_client.embeddings.create(model="emb", input="hello", encoding_format="float").data[0].embedding)
    cut = np.array(openai_client.embeddings.create(model="emb", input="hello", dimensions=16).data[0].embedding)
    assert full.shape == (64,) and cut.shape == (16,)
    assert np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    r = http.post("/v1/embeddings", json={"model": "emb", "input": "hello", "dimensions": 20})
    assert r.status_code == 400 and "one of [16, 32]" in r.json()["error"]["message"]


def test_reward_scores_equal_a_direct_forward(http, pooling_models) -> None:
    path, model, score = pooling_models["rm"]
    convo = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    r = http.post("/v1/rewards", json={"model": "rm", "messages": [convo, convo[:1]]}).json()
    text = http.post("/v1/rewards", json={"model": "rm", "input": ["a reward for this text", "and this one"]}).json()
    assert [d["index"] for d in r["data"]] == [0, 1] and r["object"] == "list"
    tok = AutoTokenizer.from_pretrained(str(path))  # the reward model's own template, as the tokenizer stage
    for conv, got in zip([convo, convo[:1]], r["data"]):
        ids = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
        want = float((direct(model, ids) @ score.T)[0])
        assert abs(got["reward"] - want) < 1e-3 * max(1.0, abs(want)), (got, want)
    assert len(text["data"]) == 2 and text["usage"]["prompt_tokens"] > 0
    pooled = http.post("/pooling", json={"model": "rm", "task": "reward", "messages": convo}).json()
    assert abs(pooled["data"][0]["data"][0] - r["data"][0]["reward"]) < 1e-6


def test_decoder_embedding_equals_a_direct_forward(http, raw, pooling_models) -> None:
    _, model, _ = pooling_models["emb"]
    ids = [[5, 17, 300, 42], [9, 8, 7]]
    got = http.post("/v1/embeddings", json={"model": "emb", "input": ids}).json()["data"]
    for seq, item in zip(ids, got):
        want = np.array(direct(model, seq))
        assert np.allclose(item["embedding"], want / np.linalg.norm(want), atol=1e-4)
    by_raw = raw.pool(ids, "emb")  # token ids straight to the engine, batched together
    assert np.allclose(np.array(by_raw), np.array([g["embedding"] for g in got]), atol=1e-6)


def test_classification_routes(http, pooling_models) -> None:
    _, model, score = pooling_models["clf"]
    for route in ("/v1/classifications", "/classify"):
        r = http.post(route, json={"model": "clf", "input": ["is this spam?", "hello"]}).json()
        assert [d["num_classes"] for d in r["data"]] == [3, 3]
        assert all(abs(sum(d["probs"]) - 1) < 1e-5 for d in r["data"])
        assert all(d["label"] == f"class_{int(np.argmax(d['probs']))}" for d in r["data"])


def test_raw_client_text_and_errors(raw) -> None:
    ref = np.load(DATA / "minilm_reference.npz")["embeddings"]
    texts = json.loads((DATA / "minilm_texts.json").read_text())[:4]
    got = np.array(raw.pool(texts, "minilm"))
    assert _cos(got, ref[:4]).min() >= 0.9999
    with pytest.raises(ClientError) as err:
        raw.pool(["x"], "nope")
    assert err.value.status == 404
    with pytest.raises(ClientError) as err:
        raw.pool([[1, 2]], "rm", task="embed")
    assert err.value.status == 400 and "reward model" in str(err.value)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"model": "rm", "input": "x"}, 400, "model"),
    ({"model": "minilm", "input": ""}, 400, "input"),
    ({"model": "minilm", "input": []}, 400, "input"),
    ({"model": "minilm", "input": ["a", 3]}, 400, "input"),
    ({"model": "minilm", "input": [40000]}, 400, "input"),
    ({"model": "minilm", "input": "word " * 400}, 400, "input"),
    ({"model": "minilm", "input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
])
def test_bad_embeddings_requests(http, body, status, param) -> None:
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_reward_route_needs_one_of_input_or_messages(http) -> None:
    r = http.post("/v1/rewards", json={"model": "rm"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_generation_still_answers(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_trainer_reward_blends_a_served_reward_model(raw, http) -> None:
    """parallm-train's rl_training.reward_model: the task's score and the served reward model's, scored in
    one batch over the trainer's ZeroMQ connection, equal to /v1/rewards' scores of the same conversations."""
    task = load_task("length")
    blended = WithRewardModel(task, raw, "rm", task_weight=0.5, model_weight=2.0)
    convs = [[{"role": "user", "content": "Say something"}, {"role": "assistant", "content": reply}]
             for reply in ("hi", "a much longer reply than the first", "ok")]
    infos = [{"finish_reason": "stop"}] * 3
    rm = [d["reward"] for d in http.post("/v1/rewards", json={"model": "rm", "messages": convs}).json()["data"]]
    want = [0.5 * t + 2.0 * r for t, r in zip(task.score(convs, infos), rm)]
    assert np.allclose(blended.score(convs, infos), want, atol=1e-5)


def test_pooling_work_is_in_the_metrics(http) -> None:
    http.post("/v1/embeddings", json={"model": "minilm", "input": ["counted"]}).raise_for_status()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # ingress polls the engine's stats every 0.5 s
        metrics = http.get("/metrics").text
        counts = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("parallm_pooling_requests_total ")]
        if counts and counts[0] > 0:
            break
        time.sleep(0.25)
    assert counts and counts[0] > 0, metrics[:2000]
    assert "parallm_pooling_passes_total" in metrics
