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
    "adapters": "/path/to/adapter", "draft_model": "small",
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


# fields that constrain the output (parallm/api/structured.py): supported on every route
CONSTRAINT_FIELDS = {
    "structured_outputs": ({"regex": "a+"}, ("regex", "a+")),
    "guided_json": ({"type": "object"}, ("json_schema", '{"type": "object"}')),
    "guided_regex": ("a+", ("regex", "a+")),
    "guided_choice": (["a", "b"], ("choice", '["a", "b"]')),
    "guided_grammar": ("root ::= \"a\"", ("gbnf", 'root ::= "a"')),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field", CONSTRAINT_FIELDS)
def test_constraint_fields_reach_the_request_spec(route, field):
    client, backend = make()
    value, (kind, text) = CONSTRAINT_FIELDS[field]
    r = client.post(route, json={**ROUTES[route], field: value, "guided_decoding_backend": "xgrammar"})
    assert r.status_code == 200, r.text
    c = backend.submits[0].spec.params.constraint
    assert (c.kind, c.value) == (kind, text)


@pytest.mark.parametrize("route", ROUTES)
def test_an_unsupported_schema_keyword_is_a_400_naming_it(route):
    client, backend = make()
    r = client.post(route, json={**ROUTES[route], "guided_json": {"type": "array", "uniqueItems": True}})
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "guided_json" and not backend.submits


@pytest.mark.parametrize("route", ROUTES)
def test_two_constraints_are_a_400(route):
    client, backend = make()
    r = client.post(route, json={**ROUTES[route], "guided_regex": "a", "structured_outputs": {"choice": ["b"]}})
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [
    {"prompts": [[1, 2]], "structured_outputs_regex": "a+"},   # TRL >= 0.20
    {"prompts": [[1, 2]], "guided_decoding_regex": "a+"},       # TRL < 0.20
    {"prompts": [[1, 2]], "generation_kwargs": {"guided_regex": "a+"}},
])
def test_trl_regex_fields_reach_the_request_spec(body):
    client, backend = make()
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    c = backend.submits[0].spec.params.constraint
    assert (c.kind, c.value) == ("regex", "a+")


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


# --------------------------------------------------------------------------- hostile bodies: a 400, never a 500

def test_invalid_utf8_is_a_400():
    client, _ = make()
    r = client.post("/v1/completions", content=b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ROUTES)
def test_json_nested_100k_deep_even_in_an_ignored_field_is_a_400(route):
    client, _ = make()
    body = b'{"max_tokens": 2, "ignored": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "deeply" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route, field, value", [
    ("/v1/completions", "seed", 2**63), ("/v1/completions", "seed", -2**63 - 1), ("/v1/completions", "top_k", 2**31),
    ("/v1/completions", "stop_token_ids", [2**40]), ("/v1/completions", "n", 2**70),
    ("/v1/completions", "max_tokens", 2**70), ("/v1/completions", "min_tokens", 2**70),
    ("/v1/completions", "prompt", [1, 2**40]),
    ("/v1/chat/completions", "chat_template_kwargs", {"a": [2**70]}),
    ("/v1/chat/completions", "max_completion_tokens", 2**70),
    ("/generate", "seed", 2**63), ("/generate", "policy_version", 2**70), ("/generate", "step_id", 2**70),
    ("/generate", "request_id", -2**70), ("/generate", "prompt_token_ids", [2**40]),
    ("/generate/", "prompts", [[1, 2**40]]), ("/generate/", "truncate_prompt_tokens", 2**70),
])
def test_integers_past_their_real_range_are_400_naming_the_field(route, field, value):
    client, backend = make()
    base = {"/generate": {"prompt": [1, 2], "max_tokens": 2}}.get(route, ROUTES[route])
    if field == "prompt_token_ids":
        base = {"max_tokens": 2}
    r = client.post(route, json={**base, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split("[")[0].split(".")[0] == field, r.text
    assert not backend.submits


def test_seed_takes_every_signed_64_bit_value():
    client, backend = make()
    for seed in (-2**63, 2**63 - 1):
        assert client.post("/v1/completions", json={**ROUTES["/v1/completions"], "seed": seed}).status_code == 200
    assert backend.submits[-1].spec.params.seed == 2**63 - 1


def test_tool_call_arguments_past_64_bits_are_a_400():
    client, _ = make()
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}, "extra": 2**70}]}, {"role": "user", "content": "x"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].tool_calls", r.text
