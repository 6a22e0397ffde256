"""/openapi.json documents every route the app serves (issue 22): a route added without an entry in
parallm/api/openapi.py (ROUTES, or `openapi.register(...)` beside the route) fails here by name."""

from __future__ import annotations

import msgspec
import pytest
from starlette.testclient import TestClient

from parallm.api import openapi
from parallm.api.app import build_app
from parallm.config import ServerConfig
from test_api_fakes import FakeBackend


def test_every_app_route_and_method_is_in_the_document():
    app = build_app(FakeBackend(), ServerConfig())
    missing = openapi.undocumented(app.routes)
    assert not missing, ("routes missing from /openapi.json: " + ", ".join(missing) + ". Add a RouteDoc to "
                         "parallm/api/openapi.py ROUTES or call parallm.api.openapi.register(method, path, summary, "
                         "RequestStruct, {200: ResponseStruct}) where the route is made.")
    served = TestClient(app).get("/openapi.json").json()
    assert served["paths"].keys() == openapi.openapi_document()["paths"].keys()


def test_the_policy_routes_are_in_the_document():
    app = build_app(FakeBackend(), ServerConfig(), policies=object())  # type: ignore[arg-type]
    assert {"/v1/rl/act", "/v1/predict", "/v1/policies"} <= {r.path for r in app.routes}
    assert not openapi.undocumented(app.routes)


def test_undocumented_names_a_route_missing_from_the_document():
    from starlette.routing import Route

    async def handler(request):  # pragma: no cover - never called
        return None

    assert openapi.undocumented([Route("/v1/new-thing/{x:path}", handler, methods=["POST", "GET"])]) == \
        ["GET /v1/new-thing/{x}", "POST /v1/new-thing/{x}"]


def test_register_documents_a_new_route_with_its_types():
    class NewRequest(msgspec.Struct):
        count: int

    before = list(openapi._EXTRA)
    try:
        openapi.register("post", "/v1/new-thing", "A new route", NewRequest)
        doc = openapi.openapi_document()
        schema = doc["paths"]["/v1/new-thing"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/NewRequest")
        assert doc["components"]["schemas"]["NewRequest"]["properties"]["count"]["type"] == "integer"
    finally:
        openapi._EXTRA[:] = before


def _refs(schema):
    if isinstance(schema, dict):
        if "$ref" in schema:
            yield schema["$ref"]
        for value in schema.values():
            yield from _refs(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _refs(value)


def test_every_ref_resolves_to_a_component():
    doc = openapi.openapi_document()
    refs = set(_refs(doc["paths"])) | set(_refs(doc["components"]))
    assert refs and all(ref.startswith("#/components/schemas/") for ref in refs)
    missing = {ref for ref in refs if ref.rsplit("/", 1)[-1] not in doc["components"]["schemas"]}
    assert not missing


def _unbounded_integers(schema, root, path, seen):
    """Paths of integer schemas without both a lower and an upper bound, refs followed once."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _unbounded_integers(item, root, f"{path}[{i}]", seen)
        return
    if not isinstance(schema, dict):
        return
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in seen:
            seen.add(name)
            yield from _unbounded_integers(root["components"]["schemas"][name], root, name, seen)
        return
    kinds = schema.get("type")
    if kinds == "integer" or isinstance(kinds, list) and "integer" in kinds:
        if not ({"minimum", "exclusiveMinimum"} & set(schema) and {"maximum", "exclusiveMaximum"} & set(schema)):
            yield path
    for key, value in schema.items():
        if key != "not":
            yield from _unbounded_integers(value, root, f"{path}.{key}", seen)


def test_every_integer_a_request_body_takes_has_its_real_range():
    """Issue 22: an integer past 64 bits was a 500 where it reached msgpack; every request integer is
    bounded in its type, so the decoder answers 400 naming the field (the document shows the bounds)."""
    doc = openapi.openapi_document()
    seen: set[str] = set()
    unbounded = [f"{method.upper()} {path}: {where}" for path, methods in doc["paths"].items()
                 for method, op in methods.items()
                 for where in _unbounded_integers(op.get("requestBody", {}).get("content", {})
                                                  .get("application/json", {}).get("schema", {}), doc, "body", seen)]
    assert not unbounded, unbounded


@pytest.mark.parametrize("path, body, field", [
    ("/v1/adapters", {"name": "a", "path": "/x"}, "version"),
    ("/v1/adapters/upload", {"name": "a", "weights": ""}, "version"),
    ("/v1/weights", {"path": "/x"}, "version"),
    ("/v1/unload_lora_adapter", {"lora_name": "a"}, "lora_int_id"),
    ("/generate", {"input_ids": [1], "return_logprob": True}, "logprob_start_len"),
])
@pytest.mark.parametrize("value", [2**70, -2**70])
def test_integers_past_their_range_on_the_admin_and_sglang_bodies_are_400(path, body, field, value):
    """The fields the test above found unbounded: each out-of-range value is a 400 naming the field,
    never a 500 from msgpack (FakeBackend would answer anything that got through with 501/404)."""
    client = TestClient(build_app(FakeBackend(), ServerConfig()), raise_server_exceptions=False)
    r = client.post(path, json={**body, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
