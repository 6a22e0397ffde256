"""End to end: the real parallm-launch on the default model, driven by the official openai client."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from parallm.client import Client

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def chat_prompt_tokens(server, messages) -> int:
    response = httpx.post(f"{server.url}/v1/tokenize", json={"messages": messages}, timeout=30)
    response.raise_for_status()
    return response.json()["count"]


def test_models_and_health(server, openai_client):
    models = openai_client.models.list()
    base = server_model(openai_client)
    served = [m.id for m in models.data if (m.model_extra or {}).get("parent") is None]
    assert served == [base, "minilm", "rm", "clf", "emb"]  # the generator, then its pooling models
    assert all(m.model_extra["parent"] == base for m in models.data[len(served):])  # loaded adapters (vLLM's listing)
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


def server_model(client) -> str:
    return client.models.list().data[0].id


def test_completion_with_logprobs_and_exact_usage(openai_client):
    model = server_model(openai_client)
    out = openai_client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                           temperature=0, logprobs=3)
    choice = out.choices[0]
    assert out.id.startswith("cmpl-") and choice.text
    assert choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.tokens) == out.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    for token, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert lp == pytest.approx(max(top.values()), abs=1e-4)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_equals_non_stream_for_greedy(server, openai_client):
    model = server_model(openai_client)
    whole = openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert whole.usage.prompt_tokens == chat_prompt_tokens(server, CHAT)
    chunks = list(openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")


def test_n_samples_and_seed(openai_client):
    model = server_model(openai_client)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Tell me a short story."}], max_tokens=16,
                  temperature=1.0, n=3, seed=1234, logprobs=True)
    first = openai_client.chat.completions.create(**kwargs)
    again = openai_client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in first.choices}) > 1
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens


def test_stop_strings_never_leak(openai_client):
    model = server_model(openai_client)
    base = openai_client.completions.create(model=model, prompt="Count: one, two, three,", max_tokens=24,
                                            temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    for stream in (False, True):
        if stream:
            chunks = list(openai_client.completions.create(model=model, prompt="Count: one, two, three,",
                                                           max_tokens=24, temperature=0, stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][-1]
        else:
            choice = openai_client.completions.create(model=model, prompt="Count: one, two, three,", max_tokens=24,
                                                      temperature=0, stop=[stop]).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert stop not in text
        assert base.startswith(text)
        assert finish == "stop"


@pytest.mark.slow  # 26 s: make test's 10-minute budget (clean clone, 2-core CI host)
def test_sixteen_concurrent_streams_batch_together(server, openai_client):
    model = server_model(openai_client)

    def one(i: int) -> str:
        stream = openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write a sentence about the number {i}."}],
            max_tokens=32, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with cf.ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(one, range(16)))
    assert all(streamed)
    # each equals its non-streamed greedy answer
    for i in (0, 7, 15):
        alone = openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write a sentence about the number {i}."}],
            max_tokens=32, temperature=0).choices[0].message.content
        assert alone == streamed[i]
    with Client(server.router) as client:
        stats = client.stats()
    assert stats.max_decode_batch > 1, stats


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "JSON"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "no-such-model"),
    ({"model": "$MODEL", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "$MODEL", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "$MODEL", "prompt": 42}, 400, "prompt"),
    ({"model": "$MODEL", "prompt": "word " * 9000}, 400, "context length"),
])
def test_bad_requests_get_openai_errors(server, openai_client, body, status, fragment):
    model = server_model(openai_client)
    if isinstance(body, dict):
        body = {k: (model if v == "$MODEL" else v) for k, v in body.items()}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    else:
        response = httpx.post(f"{server.url}/v1/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment.lower() in error["message"].lower()
    assert {"message", "type", "param", "code"} <= set(error)
    # still serving
    ok = openai_client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None


def test_openai_client_raises_typed_errors(openai_client):
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="missing", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=server_model(openai_client), messages=CHAT, max_tokens=0)
