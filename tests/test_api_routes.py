"""/v1/models, /health, /v1/tokenize, /v1/detokenize, /openapi.json and Bearer auth."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.api.backend import Backend
from parallm.config import ServerConfig
from test_api_fakes import MODEL, FakeBackend

CHAT = [{"role": "user", "content": "hi"}]


def make(backend: FakeBackend | None = None, **server) -> tuple[TestClient, FakeBackend]:
    backend = backend or FakeBackend()
    return TestClient(build_app(backend, ServerConfig(**server))), backend


def test_fake_backend_satisfies_the_protocol():
    assert isinstance(FakeBackend(), Backend)


def test_models_lists_the_served_model():
    client, _ = make()
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [(MODEL, "model", 2048)]
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["owned_by"] == "parallm"
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("status, http", [("ok", 200), ("degraded", 503), ("overloaded", 200), ("paused", 503),
                                          ("stalled", 503), ("shutting_down", 503)])
def test_health_status(status, http):
    client, _ = make(FakeBackend(status=status))
    r = client.get("/health")
    assert r.status_code == http and r.json() == {"status": status, "in_flight": 0}


def test_tokenize_prompt_and_messages():
    client, backend = make()
    body = client.post("/v1/tokenize", json={"model": MODEL, "prompt": "ab"}).json()
    assert body == {"count": 2, "max_model_len": 2048, "tokens": [97, 98]}
    call = backend.tokenize_calls[-1]
    assert (call["prompt"], call["messages"], call["add_special_tokens"]) == ("ab", None, True)
    body = client.post("/v1/tokenize", json={"messages": [{"role": "developer", "content": "c"}],
                                             "add_generation_prompt": False}).json()
    assert body["tokens"] == [99]
    call = backend.tokenize_calls[-1]
    assert call["messages"] == [{"role": "system", "content": "c"}]
    assert (call["add_generation_prompt"], call["add_special_tokens"], call["chat_template_kwargs"]) == \
        (False, False, {})


@pytest.mark.parametrize("body, param", [({}, "prompt"), ({"prompt": "a", "messages": CHAT}, "prompt"),
                                         ({"prompt": 3}, "prompt")])
def test_tokenize_needs_exactly_one_of_prompt_or_messages(body, param):
    client, _ = make()
    r = client.post("/v1/tokenize", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_detokenize():
    client, _ = make()
    assert client.post("/v1/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    r = client.post("/v1/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"


def test_openapi_lists_every_route():
    client, _ = make()
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/v1/tokenize",
            "/v1/detokenize", "/health"} <= set(doc["paths"])  # every route: tests/test_openapi_coverage.py
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref["$ref"].rsplit("/", 1)[-1] in doc["components"]["schemas"]
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_api_key_required_on_v1_only(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("filekey\n\n")
    client, backend = make(api_keys=["k1"], api_key_file=str(key_file))
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Basic k1"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "bearer filekey"}).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    assert not backend.submits


def test_no_keys_means_no_auth():
    client, _ = make()
    assert client.get("/v1/models").status_code == 200
