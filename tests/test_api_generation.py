"""/v1/completions and /v1/chat/completions bodies and streams, over a scripted Backend."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.config import ServerConfig
from parallm.protocol import unpack_ids
from test_api_fakes import MODEL, FakeBackend, words_script

CHAT = [{"role": "user", "content": "hi"}]


def make(backend: FakeBackend | None = None, **server) -> tuple[TestClient, FakeBackend]:
    backend = backend or FakeBackend()
    return TestClient(build_app(backend, ServerConfig(**server))), backend


def events(response) -> list:
    """The parsed `data:` events of an SSE body; the last must be [DONE]."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), response.text
    data = [b[len("data: "):] for b in blocks[:-1]]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_body_shape_and_exact_usage():
    client, backend = make()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say", "max_tokens": 7, "temperature": 0,
                                             "top_p": 0.5, "seed": 3, "stop": "x", "presence_penalty": 0.5,
                                             "frequency_penalty": -0.5, "logit_bias": {"5": -100}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL and body["system_fingerprint"] and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 2
    assert body["usage"]["total_tokens"] == 7
    (submit,) = backend.submits
    p = submit.spec.params
    assert (submit.prompt, p.max_tokens, p.temperature, p.top_p, p.seed) == ("Say", 7, 0.0, 0.5, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5, {5: -100.0})
    assert submit.spec.detok.stop == ["x"] and submit.spec.n == 1


def test_vllm_extensions_reach_the_sampling_params():
    client, backend = make()
    r = client.post("/v1/completions", json={"prompt": "a", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
                                             "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [7],
                                             "stop": ["a", "b"], "return_token_ids": True})
    assert r.status_code == 200, r.text
    p = backend.submits[0].spec.params
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.ignore_eos, p.stop_token_ids) == \
        (5, pytest.approx(0.1), pytest.approx(1.2), 2, True, [7])
    assert backend.submits[0].spec.detok.stop == ["a", "b"]
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [100, 101] and choice["prompt_token_ids"] == [1, 2, 3, 4, 5]


def test_chat_body_shape_and_max_completion_tokens():
    client, backend = make()
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_completion_tokens": 9,
                                                  "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world", "refusal": None}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["total_tokens"] == 7
    submit = backend.submits[0]
    assert submit.spec.params.max_tokens == 9
    assert submit.messages == [{"role": "user", "content": "hi"}] and submit.add_special_tokens is False


def test_chat_n3_choices_are_ordered_and_usage_sums():
    client, _ = make()
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "n": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello0 world0", "Hello1 world1", "Hello2 world2"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("prompt, expected", [
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([1, 2, 3], [[1, 2, 3]]),
])
def test_batched_prompts_give_choice_i_times_n_plus_j(prompt, expected):
    client, backend = make()
    body = client.post("/v1/completions", json={"prompt": prompt, "n": 2}).json()
    sent = [s.prompt if s.prompt is not None else unpack_ids(s.prompt_ids) for s in backend.submits]
    assert sent == expected
    assert len({s.rid for s in backend.submits}) == len(expected)
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(expected)))
    assert [c["text"] for c in body["choices"]] == ["Hello0 world0", "Hello1 world1"] * len(expected)
    assert body["usage"]["prompt_tokens"] == 5 * len(expected)
    assert body["usage"]["completion_tokens"] == 4 * len(expected)


def test_completion_logprobs_shape():
    client, backend = make()
    body = client.post("/v1/completions", json={"prompt": "x", "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hello", " world"]
    assert lp["token_logprobs"] == [-0.5, -1.5]
    assert lp["top_logprobs"] == [{"Hello": -0.5, "alt1": -1.5}, {" world": -1.5, "alt1": -2.5}]
    assert lp["text_offset"] == [0, 5]
    assert backend.submits[0].spec.params.top_logprobs == 2 and backend.submits[0].spec.params.logprobs


def test_completion_echo_with_logprobs_puts_the_prompt_first():
    client, _ = make()
    body = client.post("/v1/completions", json={"prompt": "Hi", "echo": True, "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == "HiHello world"
    lp = choice["logprobs"]
    assert lp["tokens"][:5] == ["p0", "p1", "p2", "p3", "p4"] and lp["tokens"][5:] == ["Hello", " world"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1] == -1.0


def test_echo_with_max_tokens_zero_returns_only_the_prompt():
    client, backend = make()
    body = client.post("/v1/completions", json={"prompt": "Hi", "echo": True, "max_tokens": 0}).json()
    assert body["choices"][0]["text"] == "Hi" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert backend.submits[0].spec.params.max_tokens == 1


def test_chat_logprobs_shape():
    client, backend = make()
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " world"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == list(b"Hello")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["Hello", "alt1"]
    assert backend.submits[0].spec.params.top_logprobs == 2


def test_streamed_completion_chunks_and_usage():
    client, _ = make()
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(r)
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hello", " world"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7


def test_streamed_completion_without_include_usage_has_no_usage_field():
    client, _ = make()
    chunks = events(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
    assert len(chunks) == 2 and all("usage" not in c for c in chunks)


def test_streamed_completion_echo_and_logprobs():
    client, _ = make()
    chunks = events(client.post("/v1/completions", json={"prompt": "Hi", "stream": True, "echo": True,
                                                         "logprobs": 1}))
    assert chunks[0]["choices"][0]["text"] == "HiHello"
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["p0", "p1", "p2", "p3", "p4", "Hello"]
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [15]


def test_streamed_chat_role_first_then_content_then_usage():
    client, _ = make()
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "n": 3,
                                                  "stream_options": {"include_usage": True}, "logprobs": True})
    chunks = events(r)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    first_seen: dict[int, dict] = {}
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        first_seen.setdefault(choice["index"], choice["delta"])
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
        if choice["delta"].get("content"):
            assert choice["logprobs"]["content"][0]["token"] == choice["delta"]["content"]
    assert all(d.get("role") == "assistant" for d in first_seen.values()) and len(first_seen) == 3
    assert texts == {j: f"Hello{j} world{j}" for j in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_streamed_text_held_back_is_not_sent_as_empty_chunks():
    def script(submit):
        from parallm.protocol import Output, Usage, pack_ids
        return [Output(rid=submit.rid, token_ids=pack_ids([1]), text=""),
                Output(rid=submit.rid, token_ids=pack_ids([2]), text="ab", finish_reason="stop", stop_reason="c",
                       usage=Usage(prompt_tokens=1, completion_tokens=2))]

    client, _ = make(FakeBackend(script=script))
    chunks = events(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("ab", "stop")]
    assert chunks[0]["choices"][0]["stop_reason"] == "c"


def test_default_max_tokens_is_capped_by_the_context():
    client, backend = make(FakeBackend(max_model_len=100))
    client.post("/v1/completions", json={"prompt": "x"})
    assert backend.submits[0].spec.params.max_tokens == 99


def test_finish_reason_stop_from_the_script():
    client, _ = make(FakeBackend(script=words_script(["a"], finish="stop")))
    body = client.post("/v1/chat/completions", json={"messages": CHAT}).json()
    assert body["choices"][0]["finish_reason"] == "stop"


def _on_event_loop() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("path, stream", [("/v1/completions", False), ("/v1/completions", True), ("/generate", False)])
def test_prompt_logprobs_are_built_off_the_event_loop(monkeypatch, path, stream):
    """Issue 30: a 6k-token prompt's prompt_logprobs (20 alternatives a position) took 0.5 s of Python to turn
    into a response (PromptInfo.of, prompt_logprobs, 7.5 MB of JSON), and on the ingress's event loop no other
    client was answered meanwhile. That work runs on a worker thread now, streamed or not, and on the RL
    routes (TRL asks 100 alternatives a position)."""
    from parallm.api import outputs, rl_render, sse

    where: list[bool] = []
    of, build = outputs.PromptInfo.of.__func__, outputs.prompt_logprobs

    def info_of(cls, out, top_k):
        if out.prompt_logprobs:
            where.append(_on_event_loop())
        return of(cls, out, top_k)

    def prompt_logprobs(info, k):
        where.append(_on_event_loop())
        return build(info, k)

    monkeypatch.setattr(outputs.PromptInfo, "of", classmethod(info_of))
    monkeypatch.setattr(outputs, "prompt_logprobs", prompt_logprobs)
    monkeypatch.setattr(sse, "prompt_logprobs", prompt_logprobs)
    monkeypatch.setattr(rl_render, "prompt_logprobs", prompt_logprobs)
    client, _ = make()
    r = client.post(path, json={"model": MODEL, "prompt": "Say", "max_tokens": 2, "prompt_logprobs": 1,
                                **({"stream": True} if stream else {})})
    assert r.status_code == 200, r.text
    first = events(r)[0] if stream else r.json()
    assert len(first["prompt_logprobs"] if path == "/generate" else first["choices"][0]["prompt_logprobs"]) == 5
    assert len(where) == 2 and not any(where)  # both steps ran, neither on the event loop
