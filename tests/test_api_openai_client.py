"""The official `openai` package parses our responses, streams and errors (in-process, no sockets)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.api.backend import BackendError
from parallm.config import ServerConfig
from parallm.protocol import Output, pack_ids
from test_api_fakes import MODEL, FakeBackend

CHAT = [{"role": "user", "content": "hi"}]


def client_for(backend: FakeBackend, **server) -> openai.OpenAI:
    http = TestClient(build_app(backend, ServerConfig(**server)), base_url="http://test")
    return openai.OpenAI(base_url="http://test/v1", api_key="sk-test", http_client=http, max_retries=0)


def test_models_completion_and_chat():
    client = client_for(FakeBackend(), api_keys=["sk-test"])
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=1)
    assert out.id.startswith("cmpl-") and out.choices[0].text == "Hello world"
    assert out.choices[0].logprobs.tokens == ["Hello", " world"]
    assert out.usage.total_tokens == 7
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, logprobs=True, top_logprobs=1)
    assert [c.message.content for c in chat.choices] == ["Hello0 world0", "Hello1 world1"]
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token == "Hello0"
    assert chat.choices[1].finish_reason == "length" and chat.usage.completion_tokens == 4


def test_streams():
    client = client_for(FakeBackend())
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].usage.total_tokens == 7 and chunks[-1].choices == []
    texts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="x", stream=True)]
    assert texts == ["Hello", " world"]


def test_errors_become_typed_exceptions():
    client = client_for(FakeBackend())
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="missing", messages=CHAT)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.AuthenticationError):
        client_for(FakeBackend(), api_keys=["other"]).models.list()


def test_error_event_mid_stream_raises_apierror():
    def script(submit):
        return [Output(rid=submit.rid, token_ids=pack_ids([1]), text="a"),
                BackendError(503, "stage_restarted", "the engine restarted", retryable=True)]

    stream = client_for(FakeBackend(script=script)).completions.create(model=MODEL, prompt="x", stream=True)
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "restarted" in str(info.value)


def test_async_client_over_asgi_transport():
    async def run():
        app = build_app(FakeBackend(), ServerConfig())
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        out = await client.chat.completions.create(model=MODEL, messages=CHAT)
        stream = await client.completions.create(model=MODEL, prompt="x", stream=True)
        texts = [c.choices[0].text async for c in stream]
        await http.aclose()
        return out, texts

    out, texts = asyncio.run(run())
    assert out.choices[0].message.content == "Hello world" and texts == ["Hello", " world"]
