"""Request fields every route shares: priority, adapter pins, the n limit, and the fields known
clients send that this server does not support yet (a 400 naming each, never a silent ignore)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.api.schemas import NotYetSupported
from parallm.config import ServerConfig
from test_api_fakes import FakeBackend

CHAT = [{"role": "user", "content": "hi"}]
ROUTES = {
    "/v1/completions": {"prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
    "/generate": {"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 2},            # vLLM shape
    "/generate/": {"prompts": [[1, 2]], "max_tokens": 2},                              # TRL shape
}
# what each known client sends (the value that asks for the behaviour)
CLIENT_FIELDS = {
    "structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'", "guided_decoding_backend": "xgrammar",
    "return_tokens_as_token_ids": True, "adapters": "/path/to/adapter", "draft_model": "small",
    "num_draft_tokens": 3, "xtc_probability": 0.5, "xtc_threshold": 0.1, "repetition_context_size": 20,
    "presence_context_size": 20, "frequency_context_size": 20, "role_mapping": {"user": "U:"},
}


def make(**backend) -> tuple[TestClient, FakeBackend]:
    fake = FakeBackend(**backend)
    return TestClient(build_app(fake, ServerConfig()), raise_server_exceptions=False), fake


def test_the_table_covers_every_declared_field():
    assert set(CLIENT_FIELDS) == set(NotYetSupported.__struct_fields__)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field", CLIENT_FIELDS)
def test_unsupported_client_fields_are_a_400_naming_them(route, field):
    client, backend = make()
    r = client.post(route, json={**ROUTES[route], field: CLIENT_FIELDS[field]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"] and error["code"] == "unsupported_parameter"
    assert not backend.submits


@pytest.mark.parametrize("route", ROUTES)
def test_null_or_false_means_not_asked(route):
    client, backend = make()
    r = client.post(route, json={**ROUTES[route], "return_tokens_as_token_ids": False, "guided_json": None,
                                 "structured_outputs": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, field", [
    ({"prompts": [[1, 2]], "structured_outputs_regex": "a+"}, "structured_outputs_regex"),   # TRL >= 0.20
    ({"prompts": [[1, 2]], "guided_decoding_regex": "a+"}, "guided_decoding_regex"),         # TRL < 0.20
    ({"prompts": [[1, 2]], "generation_kwargs": {"guided_json": {}}}, "guided_json"),
    ({"prompt": {"prompt_token_ids": [1, 2]}, "prompt_logprobs": 1}, "prompt_logprobs"),     # Atropos get_logprobs
])
def test_generate_only_fields(body, field):
    client, _ = make()
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("route", ROUTES)
def test_priority_and_adapter_pins_reach_the_request_spec(route):
    client, backend = make()
    r = client.post(route, json={**ROUTES[route], "priority": -5, "adapter": "pol", "adapter_version": 3,
                                 "min_policy_version": 2, "max_staleness": 1})
    assert r.status_code == 200, r.text
    spec = backend.submits[0].spec
    assert (spec.priority, spec.adapter, spec.adapter_version, spec.min_version, spec.max_staleness) == \
        (-5, "pol", 3, 2, 1)


@pytest.mark.parametrize("field, value", [("priority", 2**31), ("priority", -2**31 - 1), ("adapter_version", -1),
                                          ("adapter_version", 2**31), ("max_staleness", -2)])
def test_out_of_range_integers_are_400(field, value):
    client, _ = make()
    r = client.post("/v1/completions", json={**ROUTES["/v1/completions"], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("route", ROUTES)
def test_n_is_limited_by_the_engines_rows(route):
    client, backend = make(max_n=4)
    assert client.post(route, json={**ROUTES[route], "n": 4}).status_code == 200
    r = client.post(route, json={**ROUTES[route], "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "max_num_seqs" in r.json()["error"]["message"]
