"""Adapters load by path only from the configured roots (adapters.allowed_dirs), with one error for
everything outside them: a client cannot probe which server paths exist (issue 22)."""

from __future__ import annotations

import os
import shutil

import pytest
from starlette.testclient import TestClient

from parallm.adapters import AdapterError
from parallm.adapters.formats import allowed_path
from parallm.api.app import build_app
from parallm.api.backend import BackendError
from parallm.config import ServerConfig, build_config
from parallm.protocol import AdapterPublish
from parallm.stages.engine import adapter_roots, load_adapter
from test_api_fakes import FakeBackend
from tests._adapter_helpers import lora_model, save_mlx
from tests._engine_helpers import make_engine, tiny_model


def _refusal(path: str, roots: list[str]) -> str:
    with pytest.raises(AdapterError) as info:
        allowed_path(path, roots)
    assert (info.value.status, info.value.code) == (403, "adapter_path_not_allowed")
    return info.value.message.replace(repr(path), "PATH")


def test_paths_outside_the_roots_get_one_answer_whether_they_exist_or_not(tmp_path):
    root = tmp_path / "adapters"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "escape")
    assert allowed_path(str(root / "ok"), [str(root)]) == str((root / "ok").resolve())
    assert allowed_path(str(root / "missing"), [str(root)]) == str(root / "missing")  # inside: its own 404 later
    answers = {_refusal(p, [str(root)]) for p in ("/etc", "/etc/passwd", "/no/such/dir", str(tmp_path / "secret"),
                                                   str(root / "escape"), str(root / ".." / "secret"),
                                                   str(root) + "-sibling")}
    assert len(answers) == 1, answers


def test_default_roots_are_the_model_the_trainer_checkpoints_and_the_preloaded_adapters():
    config = build_config(environ={}, overrides={"model": {"path": "/models/m"},
                                                  "adapters": {"preload": ["pol=/srv/adapters/pol"]}})
    assert adapter_roots(config) == ["/models/m", config.trainer.checkpointing.dir, "/srv/adapters/pol"]
    given = build_config(environ={}, overrides={"adapters": {"allowed_dirs": ["/a", "/b"]}})
    assert adapter_roots(given) == ["/a", "/b"]


class RootedBackend(FakeBackend):
    """Adapter loads answered as the engine stage answers them, with its roots."""

    engine = None
    roots: list[str] = []

    async def load_adapter(self, request: AdapterPublish):
        try:
            return load_adapter(self.engine, request, self.roots)
        except AdapterError as exc:
            raise BackendError(exc.status, exc.code, exc.message) from None


def test_http_loads_by_path_only_under_the_roots(tmp_path):
    backend = RootedBackend()
    backend.engine = make_engine(tiny_model("llama"))
    backend.roots = [str(tmp_path / "adapters")]
    ref = tiny_model("llama")
    save_mlx(ref, lora_model(ref, rank=4), tmp_path / "adapters" / "pol")
    shutil.copytree(tmp_path / "adapters" / "pol", tmp_path / "elsewhere")  # a valid adapter, outside the roots
    client = TestClient(build_app(backend, ServerConfig()))
    assert client.post("/v1/adapters", json={"name": "pol", "path": str(tmp_path / "adapters" / "pol")}).status_code == 200
    answers = []
    for path in (str(tmp_path / "elsewhere"), "/no/such/dir", "/etc"):
        r = client.post("/v1/adapters", json={"name": "x", "path": path})
        assert r.status_code == 403, r.text
        answers.append(r.json()["error"]["message"].replace(path, "PATH"))
    assert len(set(answers)) == 1, answers
    assert list(backend.engine.adapters.versions) == ["pol"]


def test_full_weight_updates_by_path_are_confined_to_the_same_roots(tmp_path):
    from parallm.engine.weights import WeightsError
    from parallm.stages.engine import weights_path

    root = tmp_path / "checkpoints"
    (root / "step_3").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    assert weights_path(str(root / "step_3"), [str(root)]) == str((root / "step_3").resolve())
    answers = set()
    for path in ("/etc", "/no/such/dir", str(tmp_path / "secret"), str(root / ".." / "secret")):
        with pytest.raises(WeightsError) as info:
            weights_path(path, [str(root)])
        assert (info.value.status, info.value.code) == (403, "weights_path_not_allowed")
        answers.add(info.value.message.replace(repr(path), "PATH"))
    assert len(answers) == 1, answers
