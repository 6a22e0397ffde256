"""Schema-based fuzzing of the served OpenAPI document against a real server: zero 5xx.

The fuzzer reads /openapi.json, and for every operation with a JSON request body draws
- valid bodies from the body's JSON schema (`from_schema` in tests/_openapi_schema.py: a small
  walker over the subset the document uses), with generation kept cheap
  (max_tokens, n, prompt lists and logprob counts capped), and
- invalid ones: a valid body with one field replaced by arbitrary JSON, arbitrary JSON
  documents, and bytes that are not JSON at all;
then posts each one and requires a status below 500. GET and DELETE routes get random path
segments and query strings. PARALLM_FUZZ_EXAMPLES sets hypothesis' max_examples per strategy (default 10,
about a minute on a laptop CPU).
"""

from __future__ import annotations

import os
import re
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _openapi_schema import JSON, from_schema

from .server import Server

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("PARALLM_FUZZ_EXAMPLES", "10"))
MODEL = "default"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

CAPS = {"max_tokens": 2, "max_completion_tokens": 2, "max_output_tokens": 2, "n": 2, "best_of": 2, "min_tokens": 2, "logprobs": 2,
        "top_logprobs": 2, "prompt_logprobs": 2}


def cheap(body):
    """Cap what makes generation expensive, keep everything else as drawn."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    sglang = {"input_ids", "text", "sampling_params"} & set(body)
    if sglang:  # SGLang's /generate: its sampling_params (a top-level max_tokens would mix two formats)
        sampling = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
        body["sampling_params"] = {**sampling, "max_new_tokens": 2, "n": min(sampling.get("n", 1), 2)}
    elif "input" in body:  # /v1/responses
        body.setdefault("max_output_tokens", 2)
    else:
        body.setdefault("max_tokens", 2)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 2:
        body["prompt"] = prompt[:2]
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:3]
    return body


@pytest.fixture(scope="module")
def fuzz_server(server):
    """The session's server: the default tests fuzz only generation, tokenization and bodiless routes,
    and leave it healthy (the last of them checks)."""
    return server


@pytest.fixture(scope="module")
def documented_server():
    """A server of its own for the slow test that posts every documented body: pause, weight and adapter
    routes included."""
    with Server("--model.served-name", MODEL, "--server.max-concurrent-requests", "64") as srv:
        yield srv


@pytest.fixture(scope="module")
def spec(fuzz_server):
    return httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()


def body_operations(spec: dict) -> list[tuple[str, str, dict]]:
    ops = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is not None:
                # one self-contained schema: the body's $ref resolves against the components beside it
                ops.append((method, path, {**body, "components": spec["components"]}))
    return ops


def check(response: httpx.Response, what) -> None:
    assert response.status_code < 500, f"{response.status_code} for {what!r}: {response.text[:500]}"


def post(srv: Server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", timeout=300, **kwargs)


def test_the_document_has_body_operations(spec):
    paths = {path for _, path, _ in body_operations(spec)}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/v1/detokenize"} <= paths


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/tokenize",
                                  "/v1/detokenize"])
def test_valid_and_invalid_bodies_never_get_a_5xx(fuzz_server, spec, path):
    [(_, _, schema)] = [op for op in body_operations(spec) if op[1] == path]
    valid = from_schema(schema, schema)

    @FUZZ
    @given(valid)
    def valid_bodies(body):
        body = cheap(body)
        check(post(fuzz_server, path, json=body), body)

    @FUZZ
    @given(valid, st.data())
    def one_field_broken(body, data):
        body = cheap(body)
        if isinstance(body, dict) and body:
            key = data.draw(st.sampled_from(sorted(body)))
            body[key] = data.draw(JSON)
        check(post(fuzz_server, path, json=cheap(body)), body)

    @FUZZ
    @given(JSON | st.binary(max_size=64))
    def anything(doc):
        if isinstance(doc, bytes):
            check(post(fuzz_server, path, content=doc, headers={"content-type": "application/json"}), doc)
        else:
            check(post(fuzz_server, path, json=cheap(doc)), doc)

    valid_bodies()
    one_field_broken()
    anything()


def test_gets_and_deletes_with_random_paths_and_queries_never_get_a_5xx(fuzz_server, spec):
    """Every bodiless operation (GET, DELETE) with random path parameters and query strings."""
    ops = [(method, path) for path, methods in spec["paths"].items() for method in methods
           if method in ("get", "delete")]
    assert ("delete", "/v1/adapters/{name}") in ops

    @FUZZ
    @given(st.sampled_from(ops), st.text(max_size=30), st.dictionaries(st.text(max_size=8), st.text(max_size=8),
                                                                         max_size=3))
    def run(op, segment, query):
        method, path = op
        url = fuzz_server.url + re.sub(r"\{\w+\}", quote(segment, safe="") or "x", path)
        check(httpx.request(method.upper(), url, params=query, timeout=60), (op, segment, query))

    run()


def test_server_is_healthy_after_fuzzing(fuzz_server):
    assert httpx.get(f"{fuzz_server.url}/health", timeout=30).json()["status"] == "ok"
    model = httpx.get(f"{fuzz_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = post(fuzz_server, "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


GENERATING = ("/v1/completions", "/v1/chat/completions", "/generate", "/generate/", "/inference/v1/generate",
              "/v1/chat/completions/tokens", "/v1/responses")


def schema_mismatch(response: httpx.Response) -> bool:
    """A 400 from the body decoder itself (a type, a missing field, not JSON): the document said the
    body was valid, so the document and the validation disagree."""
    if response.status_code != 400:
        return False
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False  # the route's own answer shape (SGLang's {"success": false, ...}), not the decoder's
    return error.get("code") in ("missing_required_parameter", "invalid_json", "ambiguous_generate_body") \
        or ": expected `" in error.get("message", "")


@pytest.mark.slow
def test_every_documented_body_operation_no_5xx_and_no_schema_mismatch(documented_server, spec):
    """Bodies drawn from each operation's documented schema, on every route with a body: no 5xx but
    the ones the document names (the NCCL routes' 501), and no refusal by the decoder."""
    failures: list[str] = []
    for method, path, schema in body_operations(spec):
        documented = set(spec["paths"][path][method]["responses"])
        # one run per oneOf member, so that each of /generate's four formats gets its examples
        for valid in [from_schema(member, schema) for member in schema.get("oneOf", [schema])]:

            @FUZZ
            @given(valid)
            def run(body):
                body = cheap(body) if path in GENERATING else body
                r = httpx.request(method.upper(), f"{documented_server.url}{path}", json=body, timeout=300)
                if r.status_code >= 500 and str(r.status_code) not in documented:
                    failures.append(f"{r.status_code} {method} {path} {body!r:.200}: {r.text[:200]}")
                elif schema_mismatch(r):
                    failures.append(f"mismatch {method} {path} {body!r:.200}: {r.text[:300]}")

            run()
            post(documented_server, "/v1/resume")  # a pause route paused the engine: serve the next operation
    assert not failures, "\n".join(failures[:20])
    assert httpx.get(f"{documented_server.url}/health", timeout=30).json()["status"] == "ok"
