"""The adapter HTTP endpoints over a real in-process engine (the stage's query handler)."""

from __future__ import annotations

import base64
import json

import pytest
from starlette.testclient import TestClient

from parallm.adapters import AdapterError, save_bytes
from parallm.api.app import build_app
from parallm.api.backend import BackendError
from parallm.config import ServerConfig
from parallm.protocol import AdapterPublish, AdapterUnloaded
from parallm.stages.engine import adapter_list, load_adapter
from test_api_fakes import MODEL, FakeBackend
from tests._adapter_helpers import adapter_tensors, lora_model, save_mlx, to_peft
from tests._engine_helpers import make_engine, tiny_model


class EngineBackend(FakeBackend):
    """The adapter messages answered as the engine stage answers them, by an in-process engine."""

    engine = None

    async def load_adapter(self, request: AdapterPublish):
        try:
            return load_adapter(self.engine, request)
        except AdapterError as exc:
            raise BackendError(exc.status, exc.code, exc.message) from None

    async def unload_adapter(self, name: str):
        try:
            return AdapterUnloaded(qid="", name=name, versions_removed=self.engine.unload_adapter(name))
        except AdapterError as exc:
            raise BackendError(exc.status, exc.code, exc.message) from None

    async def list_adapters(self):
        return adapter_list(self.engine)


@pytest.fixture
def api(tmp_path):
    backend = EngineBackend()
    backend.engine = make_engine(tiny_model("llama"))
    ref = tiny_model("llama")
    config = lora_model(ref, rank=4)
    save_mlx(ref, config, tmp_path / "ad")
    return TestClient(build_app(backend, ServerConfig())), backend, tmp_path / "ad", (config, adapter_tensors(ref))


def test_load_list_delete(api):
    client, backend, path, _ = api
    r = client.post("/v1/adapters", json={"name": "pol", "path": str(path)})
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["policy_version"], r.json()["version"]) == ("success", 1, 1)
    r = client.post("/v1/adapters", json={"name": "pol", "path": str(path)})
    assert r.json()["version"] == 2
    listing = client.get("/v1/adapters").json()
    assert listing["policy"] == {"": 0, "pol": 2}
    [entry] = listing["data"]
    assert entry["id"] == "pol" and entry["latest_version"] == 2 and entry["bytes"] > 0
    assert [v["version"] for v in entry["versions"]] == [1, 2]
    r = client.delete("/v1/adapters/pol")
    assert r.status_code == 200 and r.json()["versions_removed"] == 2
    r = client.delete("/v1/adapters/pol")
    assert r.status_code == 404
    assert client.get("/v1/adapters").json()["data"] == []


def test_upload_json_base64_and_compat_routes(api):
    client, backend, path, (config, tensors) = api
    peft_cfg, blob = to_peft(tensors, config)
    r = client.post("/v1/adapters/upload", json={"name": "peft", "config": peft_cfg,
                                                 "weights": base64.b64encode(blob).decode()})
    assert r.status_code == 200, r.text
    assert backend.engine.adapters.latest("peft").format == "peft"
    r = client.post("/load_adapter", json={"adapter_path": str(path)})
    assert r.json() == {"status": "success", "policy_version": 1, "message": r.json()["message"]}
    r = client.post("/upload_adapter", json={"config": config, "weights": base64.b64encode(save_bytes(tensors)).decode()})
    assert r.status_code == 200 and r.json()["policy_version"] == 2
    assert backend.engine.policy() == {"": 0, "peft": 1, "default": 2}


def test_upload_multipart_as_the_rl_inference_server_sends_it(api):
    client, backend, _, (config, tensors) = api
    blob = save_bytes(tensors)
    files = {"adapter_weights": ("adapters.safetensors", blob, "application/octet-stream"),
             "adapter_config": ("adapter_config.json", json.dumps(config), "application/json")}
    r = client.post("/upload_adapter", files=files)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "success", "policy_version": 1, "message": r.json()["message"]}
    assert backend.engine.policy() == {"": 0, "default": 1}
    r = client.post("/v1/adapters/upload", files={"weights": ("w.safetensors", blob)},
                    data={"name": "pol", "version": "7", "format": "mlx", "config": json.dumps(config)})
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["version"]) == ("pol", 7)
    loaded = backend.engine.adapters.latest("pol")
    assert loaded.format == "mlx" and loaded.version == 7
    peft_cfg, peft_blob = to_peft(tensors, config)
    r = client.post("/v1/adapters/upload", files={"file": ("adapter_model.safetensors", peft_blob),
                                                  "config": ("adapter_config.json", json.dumps(peft_cfg))},
                    data={"name": "peft"})
    assert r.status_code == 200, r.text
    assert backend.engine.adapters.latest("peft").format == "peft"


def test_multipart_upload_errors(api):
    client, backend, _, (config, tensors) = api
    blob, cfg = save_bytes(tensors), json.dumps(config)

    def post(files=None, data=None, **kw):
        r = client.post("/v1/adapters/upload", files=files, data=data, **kw)
        assert r.status_code >= 400, r.text
        return r.status_code, r.json()["error"]

    status, err = post(data={"name": "x", "config": cfg, "version": "1"})
    assert status == 400 and err["param"] == "adapter_weights" and "safetensors file" in err["message"]
    status, err = post(files={"adapter_weights": ("a", blob), "weights": ("b", blob)})
    assert status == 400 and "exactly one" in err["message"]
    status, err = post(files={"adapter_weights": ("a", blob)}, data={"adapter_config": "{not json"})
    assert status == 400 and err["param"] == "adapter_config" and "not JSON" in err["message"]
    status, err = post(files={"adapter_weights": ("a", blob)}, data={"config": "[1, 2]"})
    assert status == 400 and "JSON object" in err["message"]
    status, err = post(files={"adapter_weights": ("a", blob)}, data={"config": cfg, "version": "two"})
    assert status == 400 and err["param"] == "version"
    status, err = post(files={"adapter_weights": ("a", blob)}, data={"config": cfg, "colour": "red"})
    assert status == 400 and err["param"] == "colour" and "unknown multipart field" in err["message"]
    status, err = post(files={"adapter_weights": ("a", blob)}, data={"config": cfg, "format": "onnx"})
    assert status == 400 and err["param"] == "format"
    status, err = post(data={"adapter_weights": "not a file", "config": cfg})
    assert status == 400 and "must be a file" in err["message"]
    status, err = post(files={"adapter_weights": ("a", b"garbage")}, data={"config": cfg})
    assert status == 400 and "safetensors" in err["message"]
    status, err = post(content=b"--x\r\nnonsense", headers={"content-type": "multipart/form-data"})
    assert status == 400 and "multipart" in err["message"]
    status, err = post(content=b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--\r\n",
                       headers={"content-type": "multipart/form-data; boundary=b"})
    assert status == 400
    assert backend.engine.policy() == {"": 0}  # nothing was loaded by any of them
    small = TestClient(build_app(backend, ServerConfig(max_body_bytes=1000)))
    r = small.post("/v1/adapters/upload", files={"adapter_weights": ("a", blob)}, data={"config": cfg})
    assert r.status_code == 413
    r = client.post("/v1/adapters/upload", files={"adapter_weights": ("a", blob)}, data={"config": cfg})
    assert r.status_code == 200, r.text  # and serving goes on


def test_errors_are_precise(api):
    client, backend, path, (config, tensors) = api
    r = client.post("/v1/adapters", json={"name": "x", "path": "/no/such/dir"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    bad = dict(tensors)
    k = next(iter(bad))
    bad[k] = bad[k] * float("nan")
    r = client.post("/v1/adapters/upload", json={"name": "x", "config": config,
                                                 "weights": base64.b64encode(save_bytes(bad)).decode()})
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"]
    r = client.post("/v1/adapters/upload", json={"name": "x", "config": config, "weights": "!!"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weights"
    r = client.post("/v1/adapters", json={"name": "x"})
    assert r.status_code == 400
    assert backend.engine.policy() == {"": 0}


def test_adapter_chosen_by_model_suffix_or_field():
    client, backend = TestClient(build_app(FakeBackend(), ServerConfig())), None
    backend = client.app.state.backend
    body = {"prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/completions", json={**body, "model": f"{MODEL}:pol"}).status_code == 200
    assert client.post("/v1/completions", json={**body, "model": MODEL, "adapter": "b"}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": f"{MODEL}:c"}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert [s.spec.adapter for s in backend.submits] == ["pol", "b", "c"]
    r = client.post("/v1/completions", json={**body, "model": f"{MODEL}:pol", "adapter": "other"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapter"
    assert client.post("/v1/completions", json={**body, "model": "elsewhere:pol"}).status_code == 404
