"""generation_config.json sampling defaults (model.generation_config, vLLM's --generation-config):
the OpenAI routes fill the fields a request omits from the model's file, a request's own value
always wins, and the RL /generate route and raw clients get exactly what they send."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from test_api_fakes import MODEL, FakeBackend

from parallm.api.app import build_app
from parallm.config import ConfigError, ModelConfig, ServerConfig, parse_args
from parallm.protocol import SamplingParams
from parallm.text.generation_config import generation_defaults, parse_generation_config

FILE = {"temperature": 0.0, "top_k": 1, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3,
        "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}


def model_dir(tmp_path, contents=FILE):
    (tmp_path / "generation_config.json").write_text(json.dumps(contents))
    return tmp_path


def test_the_file_read_as_vllm_reads_it(tmp_path):
    got = generation_defaults(ModelConfig(path=str(model_dir(tmp_path))))
    assert got.sampling == {"temperature": 0.0, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3, "top_k": 1}
    assert got.max_tokens == 7 and got.source.endswith("generation_config.json")
    assert generation_defaults(ModelConfig(path=str(tmp_path), generation_config="none")).sampling == {}
    (tmp_path / "other").mkdir()
    other = model_dir(tmp_path / "other", {"temperature": 0.6})
    assert generation_defaults(ModelConfig(path=str(tmp_path), generation_config=str(other))).sampling == \
        {"temperature": 0.6}
    # no file: nothing (auto); a DIR without one is an error naming it
    assert generation_defaults(ModelConfig(path=str(tmp_path / "missing"))).sampling == {}
    with pytest.raises(ValueError, match="does not exist"):
        generation_defaults(ModelConfig(path=str(tmp_path), generation_config=str(tmp_path / "other" / "x")))
    # nulls and the keys vLLM ignores count as absent; top_k -1 (HF/vLLM "off") is 0 here
    assert parse_generation_config({"temperature": None, "top_k": -1, "num_beams": 4}).sampling == {"top_k": 0}


@pytest.mark.parametrize("bad, match", [({"temperature": "hot"}, "temperature must be a finite number"),
                                        ({"top_p": 0}, r"top_p 0.0 is outside"),
                                        ({"top_k": 2.5}, "top_k must be an integer"),
                                        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
                                        ({"repetition_penalty": True}, "repetition_penalty must be a finite")])
def test_bad_values_are_refused_naming_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_generation_config(bad)


def test_the_flag(tmp_path):
    assert parse_args(["--generation-config", "none"])[0].model.generation_config == "none"
    assert parse_args(["--model.generation-config", "auto"])[0].model.generation_config is None
    assert parse_args(["--generation-config", str(tmp_path)])[0].model.generation_config == str(tmp_path)
    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--generation-config", str(tmp_path / "nowhere")])


@pytest.fixture
def api(tmp_path):
    defaults = generation_defaults(ModelConfig(path=str(model_dir(tmp_path))))
    backend = FakeBackend(sampling_defaults=defaults.sampling, default_max_tokens=defaults.max_tokens)
    return TestClient(build_app(backend, ServerConfig())), backend


def _params(backend) -> SamplingParams:
    return backend.submits[-1].spec.params


def test_openai_routes_take_the_files_defaults_for_omitted_fields(api):
    client, backend = api
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        assert client.post(path, json={"model": MODEL, **body}).status_code == 200
        p = _params(backend)
        assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.max_tokens) == \
            (0.0, 1, 0.9, 0.05, 1.3, 7), path
        # a request's own values win, field by field (zeros included)
        mine = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                "max_tokens": 3 if path == "/v1/completions" else None}
        mine = {k: v for k, v in mine.items() if v is not None}
        if path != "/v1/completions":
            mine["max_completion_tokens"] = 3
        assert client.post(path, json={"model": MODEL, **body, **mine}).status_code == 200
        p = _params(backend)
        assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.max_tokens) == \
            (0.8, 0, 1.0, 0.0, 1.0, 3), path
        assert client.post(path, json={"model": MODEL, **body, "temperature": 0.5}).status_code == 200
        assert (_params(backend).temperature, _params(backend).top_k) == (0.5, 1), "the others keep the file's"


def test_the_rl_generate_route_gets_exact_parameters(api):
    """RL clients want the sampling they ask for: /generate ignores the model's defaults."""
    client, backend = api
    r = client.post("/generate", json={"prompt": [1, 2, 3], "max_tokens": 3})
    assert r.status_code == 200, r.text
    p = _params(backend)
    default = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == \
        (default.temperature, default.top_k, default.top_p, default.min_p, default.repetition_penalty)
