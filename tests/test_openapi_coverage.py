"""/openapi.json documents every route the app serves (issue 22): a route added without an entry in
parallm/api/openapi.py (ROUTES, or `openapi.register(...)` beside the route) fails here by name."""

from __future__ import annotations

import msgspec
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
