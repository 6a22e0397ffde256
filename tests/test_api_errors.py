"""OpenAI error bodies and statuses, errors after a stream began, timeouts, and client disconnects."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.api.backend import BackendError
from parallm.config import ServerConfig
from parallm.protocol import Output, pack_ids
from test_api_fakes import FakeBackend

CHAT = [{"role": "user", "content": "hi"}]


def make(backend: FakeBackend | None = None, **server) -> tuple[TestClient, FakeBackend]:
    backend = backend or FakeBackend()
    return TestClient(build_app(backend, ServerConfig(**server)), raise_server_exceptions=False), backend


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": 42}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": []}, "prompt", None),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt", None),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, "stop", None),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0]", None),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice", None),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {}}}}}, "response_format", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -5}, "max_completion_tokens",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0].type", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url", None),
])
def test_bad_input_is_400_naming_the_field(path, body, param, code):
    client, backend = make()
    error = error_of(client.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code
    assert not backend.submits


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_400(body):
    client, _ = make()
    error = error_of(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error"
    assert "json" in error["message"].lower() or "expected `object`" in error["message"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"model": "nope", "prompt": "x"}),
                                        ("/v1/chat/completions", {"model": "nope", "messages": CHAT}),
                                        ("/v1/tokenize", {"model": "nope", "prompt": "x"})])
def test_unknown_model_is_404_model_not_found(path, body):
    client, _ = make()
    error = error_of(client.post(path, json=body), 404)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "nope" in error["message"]


def test_unknown_route_404_and_wrong_method_405():
    client, _ = make()
    error = error_of(client.get("/v1/nothing"), 404)
    assert error["code"] == "unknown_url"
    r = client.get("/v1/chat/completions")
    assert error_of(r, 405)["code"] == "method_not_allowed" and "POST" in r.headers["allow"]


def test_backend_400_keeps_status_code_and_param():
    backend = FakeBackend(error_at_start=BackendError(400, "context_length_exceeded", "This model's maximum context "
                                                      "length is 2048 tokens", param="prompt"))
    client, _ = make(backend)
    for stream in (False, True):
        error = error_of(client.post("/v1/completions", json={"prompt": "x", "stream": stream}), 400)
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
        assert "context length" in error["message"]


def test_backend_503_retryable_gets_retry_after():
    backend = FakeBackend(error_at_start=BackendError(503, "shutting_down", "the server is shutting down",
                                                      retryable=True))
    client, _ = make(backend)
    r = client.post("/v1/chat/completions", json={"messages": CHAT})
    error = error_of(r, 503)
    assert error["type"] == "server_error" and error["code"] == "shutting_down"
    assert r.headers["retry-after"] == "1"
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_backend_error_mid_stream_is_an_error_event_then_done():
    def script(submit):
        return [Output(rid=submit.rid, token_ids=pack_ids([1]), text="Hi"),
                BackendError(503, "stage_restarted", "the engine restarted", retryable=True)]

    client, backend = make(FakeBackend(script=script))
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert r.status_code == 200
    data = [b[len("data: "):] for b in r.text.split("\n\n") if b]
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "stage_restarted")
    assert json.loads(data[1])["choices"][0]["delta"]["content"] == "Hi"
    assert backend.iterators[0].closed


def test_error_finish_reason_is_a_500_error_not_a_crash():
    def script(submit):
        return [Output(rid=submit.rid, token_ids=pack_ids([1]), finish_reason="error")]

    client, _ = make(FakeBackend(script=script))
    assert error_of(client.post("/v1/completions", json={"prompt": "x"}), 500)["type"] == "server_error"


def test_unexpected_exception_is_logged_and_a_500_error_body(caplog):
    def script(submit):
        raise RuntimeError("boom")

    client, _ = make(FakeBackend(script=script))
    error = error_of(client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert error["code"] == "internal_error" and "boom" not in error["message"]
    assert "boom" in caplog.text


def test_unexpected_exception_mid_stream_is_an_error_event():
    def script(submit):
        return [Output(rid=submit.rid, token_ids=pack_ids([1]), text="a"), ValueError("bad")]

    client, _ = make(FakeBackend(script=script))
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    data = [b[len("data: "):] for b in r.text.split("\n\n") if b]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "internal_error"


def test_body_over_the_limit_is_413():
    client, backend = make(max_body_bytes=100)
    error = error_of(client.post("/v1/completions", json={"prompt": "x" * 200}), 413)
    assert error["code"] == "request_too_large"
    def chunks():
        yield b'{"prompt": "'
        yield b"x" * 200
        yield b'"}'
    assert error_of(client.post("/v1/completions", content=chunks()), 413)["code"] == "request_too_large"
    assert not backend.submits


@pytest.mark.parametrize("prompt", ["x", ["a", "b"]])
def test_first_token_timeout_is_504(prompt):
    client, backend = make(FakeBackend(hang_after=0), first_token_timeout_s=0.05)
    error = error_of(client.post("/v1/completions", json={"prompt": prompt}), 504)
    assert error["code"] == "timeout" and "first token" in error["message"]
    assert backend.iterators and all(it.closed for it in backend.iterators)


def test_request_timeout_mid_stream_is_an_error_event():
    client, backend = make(FakeBackend(hang_after=1), request_timeout_s=0.1)
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    data = [b[len("data: "):] for b in r.text.split("\n\n") if b]
    assert json.loads(data[0])["choices"][0]["text"] == "Hello"
    assert json.loads(data[-2])["error"]["code"] == "timeout" and data[-1] == "[DONE]"
    assert backend.iterators[0].closed


# --------------------------------------------------------------------------- disconnects

async def _drive(app, body: dict, backend: FakeBackend) -> list[dict]:
    """Run one request through the raw ASGI app; the client disconnects once the backend hangs."""
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": msgspec.json.encode(body), "more_body": False}
        await backend.hanging.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": body.pop("_path"), "raw_path": b"", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1),
             "server": ("t", 80)}
    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@pytest.mark.parametrize("body, hang_after, iterators", [
    ({"_path": "/v1/completions", "prompt": "x", "stream": True}, 1, 1),
    ({"_path": "/v1/chat/completions", "messages": CHAT, "stream": True}, 1, 1),
    ({"_path": "/v1/completions", "prompt": "x"}, 1, 1),
    ({"_path": "/v1/completions", "prompt": "x", "stream": True}, 0, 1),     # still in "prefill"
    ({"_path": "/v1/completions", "prompt": ["a", "b"], "stream": True}, 1, 2),
    ({"_path": "/v1/completions", "prompt": ["a", "b"]}, 0, 2),
])
def test_client_disconnect_closes_every_backend_iterator(body, hang_after, iterators):
    async def run():
        backend = FakeBackend(hang_after=hang_after)
        app = build_app(backend, ServerConfig())
        sent = await _drive(app, dict(body), backend)
        return backend, app, sent

    backend, app, sent = asyncio.run(run())
    assert len(backend.iterators) == iterators
    assert all(it.closed for it in backend.iterators)
    assert app.state.generator.gate.in_flight == 0
    streamed = b"".join(m.get("body", b"") for m in sent)
    assert b"[DONE]" not in streamed


def test_testclient_closing_a_stream_early_closes_the_backend():
    backend = FakeBackend(hang_after=1)
    client, _ = make(backend)
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    assert backend.iterators[0].closed


def test_429_past_max_concurrent_requests():
    import httpx

    async def run():
        backend = FakeBackend(hang_after=0)
        app = build_app(backend, ServerConfig(max_concurrent_requests=1))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            first = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x"}))
            await asyncio.wait_for(backend.hanging.wait(), 5)
            second = await client.post("/v1/completions", json={"prompt": "x"})
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        return second

    r = asyncio.run(run())
    assert error_of(r, 429)["code"] == "rate_limit_exceeded" and r.headers["retry-after"] == "1"


def test_a_stream_frees_its_slot_before_its_done_event():
    """A closed-loop client sends its next request as soon as it reads [DONE]: at that moment its
    finished request no longer counts against max_concurrent_requests (it was a 429 at c=256)."""
    async def run():
        backend = FakeBackend()
        app = build_app(backend, ServerConfig(max_concurrent_requests=1))
        in_flight_at_done = []
        body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 4}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)

        async def send(message):
            if b"[DONE]" in message.get("body", b""):
                in_flight_at_done.append(app.state.generator.gate.in_flight)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("t", 1), "server": ("t", 80)}
        await asyncio.wait_for(app(scope, receive, send), 5)
        return in_flight_at_done, app.state.generator.gate.in_flight

    at_done, after = asyncio.run(run())
    assert at_done == [0] and after == 0
