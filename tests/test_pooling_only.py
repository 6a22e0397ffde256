"""A server whose model.path is a pooling model (issue 31): which models are served that way (model.task,
auto-detected from the directory), what such a server cannot be asked to do (config), and its HTTP face
(the pooling routes and /v1/models serve; every generation route answers 400 naming why). The whole server
through parallm-launch and the openai client: tests/e2e/test_pooling_only.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_api_fakes import FakeBackend

from parallm.api.app import SERVED_WITHOUT_GENERATOR, build_app
from parallm.config import ConfigError, ModelConfig, ServerConfig, build_config, generates
from parallm.models import ModelLoadError
from parallm.models.resolve import resolve_model
from parallm.pooling.load import resolve_served_model
from parallm.pooling.spec import PoolingInfo, pooling_task
from tests._pooling_helpers import write_decoder


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-only")
    st = root / "st-embed"  # a decoder with a sentence-transformers last-token Pooling module
    write_decoder(st, "embed", seed=2)
    (st / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"},
                                                 {"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.Pooling"}]))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return {"rm": write_decoder(root / "rm", "seqcls", seed=3)[0],
            "clf": write_decoder(root / "clf", "seqcls", seed=4, labels=3)[0],
            "bare": write_decoder(root / "bare", "embed", seed=5)[0], "st": st,
            "lm": resolve_model(ModelConfig(path="default"), progress=False).path}


def test_auto_serves_a_pooling_directory_as_its_task(dirs: dict[str, Path]) -> None:
    assert pooling_task(dirs["rm"]) == "reward" and pooling_task(dirs["clf"]) == "classify"
    assert pooling_task(dirs["st"]) == "embed"
    assert pooling_task(dirs["lm"]) is None and pooling_task(dirs["bare"]) is None  # a bare backbone: generate
    entry, task = resolve_served_model(ModelConfig(path=str(dirs["rm"])))
    assert task == "reward" and entry == f"rm:reward={dirs['rm'].resolve()}"
    entry, task = resolve_served_model(ModelConfig(path=str(dirs["st"]), served_name="mine"))
    assert (entry.partition("=")[0], task) == ("mine:embed", "embed")
    for path in ("default", str(dirs["lm"]), "x.gguf"):
        assert resolve_served_model(ModelConfig(path=path)) is None
    assert resolve_served_model(ModelConfig(path=str(dirs["rm"]), task="generate")) is None


def test_a_given_task_serves_the_model_for_it(dirs: dict[str, Path]) -> None:
    entry, task = resolve_served_model(ModelConfig(path=str(dirs["bare"]), task="embed"))
    assert task == "embed" and entry.startswith("bare:embed=")
    entry, task = resolve_served_model(ModelConfig(path="default", task="embed"))  # the embedded MiniLM
    assert entry.startswith("all-MiniLM-L6-v2:embed=") and task == "embed"
    with pytest.raises(ModelLoadError, match="task 'embed' only"):
        resolve_served_model(ModelConfig(path="default", task="reward"))
    with pytest.raises(ModelLoadError, match="sequence-classification|score"):
        from parallm.pooling.load import load_entry

        load_entry(resolve_served_model(ModelConfig(path=str(dirs["bare"]), task="reward"))[0])


@pytest.mark.parametrize("cli, setting", [
    ({"engine": {"replicas": 2}}, "engine.replicas"), ({"engine": {"tensor_parallel": 2}}, "engine.tensor_parallel"),
    ({"trainer": {"enabled": True}}, "trainer.enabled"), ({"adapters": {"preload": ["a=/x"]}}, "adapters.preload")])
def test_what_needs_a_generator_is_refused_with_a_pooling_task(cli: dict, setting: str) -> None:
    with pytest.raises(ConfigError, match=f"{setting}( > 1)? needs a text generator"):
        build_config(environ={}, cli={"model": {"task": "embed"}, **cli})
    assert generates(build_config(environ={}, cli=cli)) is True  # auto: the supervisor decides


def _pooling_app() -> TestClient:
    info = PoolingInfo(name="mini", task="embed", family="encoder", pooling="mean", normalize=True, dims=4,
                       max_len=256)
    backend = FakeBackend(model_name="mini", pooling_models={"mini": info})
    return TestClient(build_app(backend, ServerConfig(), generates=False), raise_server_exceptions=False)


@pytest.mark.parametrize("method, path", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/responses"), ("POST", "/generate"),
                                          ("POST", "/v1/load_lora_adapter"), ("POST", "/update_weights"),
                                          ("GET", "/v1/policy"), ("POST", "/reset_prefix_cache")])
def test_generation_routes_answer_400_naming_why(method: str, path: str) -> None:
    r = _pooling_app().request(method, path, json={"model": "mini", "prompt": "x"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_generative" and error["param"] == "model"
    assert "no text generator" in error["message"] and "'mini' is an embedding model" in error["message"]
    assert "/v1/embeddings" in error["message"]


def test_models_health_and_unknown_routes() -> None:
    client = _pooling_app()
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("mini", 256)]
    assert client.get("/v1/models/mini").json()["id"] == "mini"
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/health").status_code == 200 and client.get("/openapi.json").status_code == 200
    assert client.get("/no/such/route").status_code == 404
    assert client.get("/v1/chat/completions").status_code == 405  # a refused route keeps its methods
    assert "/v1/embeddings" in SERVED_WITHOUT_GENERATOR


def test_a_generator_lists_its_pooling_models_after_itself() -> None:
    info = PoolingInfo(name="emb", task="embed", family="encoder", pooling="mean", normalize=True, dims=4, max_len=128)
    backend = FakeBackend(pooling_models={"emb": info})
    cards = TestClient(build_app(backend, ServerConfig())).get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [backend.model_name, "emb"]
