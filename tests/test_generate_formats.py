"""POST /generate's format rule (parallm/api/rl_shape.py) and /openapi.json's oneOf
(parallm/api/openapi_generate.py) agree (issue 22): every body the pinned RL clients send is read
as its client's format and matches exactly that member of the document; a body mixing two formats'
fields, or without its prompt, is a 400 naming why and matches no member; and bodies drawn from
each member, posted to the app, are read as that member's format and answered in its shape."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from _openapi_schema import from_schema, matches
from parallm.api.app import build_app
from parallm.api.errors import APIError
from parallm.api.openapi import openapi_document
from parallm.api.rl_shape import shape_of
from parallm.config import ServerConfig
from test_api_fakes import FakeBackend

DOC = openapi_document()
SCHEMA = DOC["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
MEMBERS = {m["x-parallm-format"]: m for m in SCHEMA["oneOf"]}

CLIENT_BODIES = [  # the bodies of docs/rl.md's client table (tests/test_rl_clients.py pins their sources)
    ("vllm", {"prompt": {"prompt_token_ids": [1, 504, 3458]}, "logprobs": 0, "n": 2, "max_tokens": 3,
              "temperature": 1.0, "top_p": 1.0, "stop": ["User:"]}),                       # Atropos vllm
    ("vllm", {"prompt": {"prompt_token_ids": [1, 504, 3458, 282]}, "prompt_logprobs": 2, "n": 1,
              "temperature": 0.0, "top_p": 1.0, "max_tokens": 1}),                          # Atropos get_logprobs
    ("vllm", {"prompt": "San Francisco is a", "max_tokens": 3, "model": "m"}),               # vLLM api_server
    ("vllm", {"prompt_token_ids": [1, 2], "max_tokens": 2}),
    ("vllm", {"prompt": ["a", {"prompt_token_ids": [1]}], "n": 2}),
    ("trl", {"prompts": [[1, 2]], "n": 2, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
             "top_k": -1, "min_p": 0.0, "max_tokens": 16, "truncate_prompt_tokens": None,
             "guided_decoding_regex": None, "generation_kwargs": {}}),                        # TRL 0.24
    ("trl", {"prompts": [[1, 2]], "images": None, "n": 2, "repetition_penalty": 1.0, "temperature": 1.0,
             "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 16, "logprobs": 1,
             "truncate_prompt_tokens": None, "structured_outputs_regex": None,
             "generation_kwargs": {"seed": 3}}),                                               # TRL 0.29
    ("trl", {"prompts": ["Hello"], "n": 2, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
             "top_k": -1, "min_p": 0.0, "max_tokens": 3}),                                     # Atropos trl
    ("mlx_rl", {"prompt": "What is machine learning?", "temperature": 0.7, "top_p": 1.0, "max_tokens": 128,
                "logprobs": 1, "policy_version": 42, "step_id": 1000,
                "request_id": "unique-request-id"}),                                           # MLX RL README
    ("mlx_rl", {"prompt": [1, 504, 3458], "max_tokens": 3}),
    ("mlx_rl", {"prompt": "hi", "logprobs": True}),
    ("sglang", {"input_ids": [1, 504, 3458], "sampling_params": {"n": 2, "temperature": 1.0, "max_new_tokens": 3},
                "return_logprob": True, "return_text_in_logprobs": False}),                   # Atropos sglang
    ("sglang", {"sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8,
                                    "stop": None, "stop_token_ids": None, "skip_special_tokens": True,
                                    "no_stop_trim": True, "spaces_between_special_tokens": False},
                "return_logprob": True, "input_ids": [1, 2, 3], "return_routed_experts": True}),  # slime
    ("sglang", {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 2}}),     # SkyRL-train
    ("sglang", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    # images (a vision-language model: docs/vision.md)
    ("trl", {"prompts": ["<image>What?"], "images": ["iVBORw0KGgo="], "max_tokens": 2}),     # TRL pil_to_base64
    ("vllm", {"prompt": {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": "data:image/png;base64,x"}}}),
    ("sglang", {"text": ["<image>a", "b"], "image_data": [["data:image/png;base64,x"], None],
                "sampling_params": {"max_new_tokens": 2}}),                                   # slime, batched
]

MIXED = [  # fields of two formats: (body, the fields the 400 names)
    ({"prompts": ["a"], "input_ids": [1]}, ["prompts", "input_ids"]),
    ({"prompts": ["a"], "prompt": "b"}, ["prompts", "prompt"]),
    ({"prompt": {"prompt_token_ids": [1]}, "policy_version": 3}, ["prompt", "policy_version"]),
    ({"prompt": [1, 2], "prompt_logprobs": 1}, ["prompt", "prompt_logprobs"]),
    ({"input_ids": [1], "temperature": 0.5}, ["input_ids", "temperature"]),
    ({"prompt": "x", "generation_kwargs": {"seed": 1}}, ["generation_kwargs", "prompt"]),
    ({"text": "x", "request_id": "r"}, ["text", "request_id"]),
    ({"prompt_token_ids": [1], "logprobs": True}, ["prompt_token_ids", "logprobs"]),
]

NO_PROMPT = [  # (body, the field the 400 names, a word of its message)
    ({"n": 2, "max_tokens": 3}, "prompt", "Missing the prompt"),
    ({"prompt": None, "prompt_token_ids": None}, "prompt", "vLLM's format (it has prompt_token_ids)"),
    ({"sampling_params": {"max_new_tokens": 2}}, "input_ids", "SGLang"),
    ({"policy_version": 1, "max_tokens": 3}, "prompt", "MLX RL"),
    ({"generation_kwargs": {"seed": 1}}, "prompts", "TRL"),
]


def members_matching(body) -> list[str]:
    return [name for name, member in MEMBERS.items() if matches(body, member, DOC)]


@pytest.mark.parametrize("expected, body", CLIENT_BODIES)
def test_client_bodies_are_read_as_their_format_and_match_that_member_only(expected, body):
    assert shape_of(body) == expected
    assert members_matching(body) == [expected]
    assert matches(body, SCHEMA, DOC)


@pytest.mark.parametrize("body, fields", MIXED)
def test_fields_of_two_formats_are_a_400_naming_them_and_match_no_member(body, fields):
    with pytest.raises(APIError) as err:
        shape_of(body)
    assert (err.value.status, err.value.code) == (400, "ambiguous_generate_body")
    named = err.value.message.split(": ", 1)[1]
    assert [part.split(" (")[0] for part in named.split(". ")[0].split(", ") if " (" in part] == fields
    assert err.value.param == fields[-1]
    assert members_matching(body) == []


@pytest.mark.parametrize("body, param, says", NO_PROMPT)
def test_a_body_without_its_prompt_is_a_400_naming_it_and_matches_no_member(body, param, says):
    with pytest.raises(APIError) as err:
        shape_of(body)
    assert (err.value.status, err.value.code, err.value.param) == (400, "missing_required_parameter", param)
    assert says in err.value.message
    assert members_matching(body) == []


def test_the_document_names_the_rule_and_each_format_s_own_fields():
    assert set(MEMBERS) == {"vllm", "trl", "mlx_rl", "sglang"}
    only = SCHEMA["x-parallm-discriminator"]
    assert "prompts" in only["trl"] and "input_ids" in only["sglang"] and "policy_version" in only["mlx_rl"]
    assert "prompt_logprobs" in only["vllm"] and "ambiguous_generate_body" in SCHEMA["description"]


def answered_in(shape: str, out) -> bool:
    """Whether a 200's body is in `shape`'s answer shape (docs/rl.md)."""
    if shape == "sglang":
        return all("meta_info" in o for o in (out if isinstance(out, list) else [out]))
    if not isinstance(out, dict):
        return False
    return {"vllm": "token_ids" in out and "completion_ids" not in out,
            "trl": "completion_ids" in out and "policy_version" not in out,
            "mlx_rl": "completion_ids" in out and "policy_version" in out}[shape]


MISMATCH_CODES = ("missing_required_parameter", "invalid_json", "ambiguous_generate_body")
CLIENT = TestClient(build_app(FakeBackend(), ServerConfig()), raise_server_exceptions=False)


def cheap(body: dict) -> dict:
    """Keep what a drawn body asks the scripted backend small (n, tokens), everything else as drawn."""
    body = {k: v for k, v in body.items() if k != "min_tokens"}
    sampling = body.get("sampling_params")
    if isinstance(sampling, dict):
        body["sampling_params"] = {**sampling, "n": 1, "max_new_tokens": 2}
    elif "input_ids" not in body and "text" not in body:
        body.update(n=1, max_tokens=2)
    return body


@pytest.mark.parametrize("shape", ["vllm", "trl", "mlx_rl", "sglang"])
def test_bodies_drawn_from_each_member_are_read_as_it_and_answered_in_its_shape(shape):
    member = MEMBERS[shape]

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(from_schema(member, DOC))
    def run(body):
        body = cheap(body)
        assert members_matching(body) == [shape], body
        assert shape_of(body) == shape, body
        r = CLIENT.post("/generate", json=body)
        assert r.status_code in (200, 400), (r.status_code, r.text, body)
        if r.status_code == 200:
            assert answered_in(shape, r.json()), (body, r.text[:300])
        else:
            error = r.json()["error"]
            assert error["code"] not in MISMATCH_CODES and ": expected `" not in error["message"], (body, error)

    run()
