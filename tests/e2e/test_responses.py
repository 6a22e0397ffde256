"""End to end: /v1/responses on the session server (the default model), driven by the official openai
client (its version is in docs/openai-api.md). Assertions are grouped so the file costs a few
generations of a 135M model, not a server start of its own."""

from __future__ import annotations

import json
import time
import uuid

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from .test_openai_api import chat_prompt_tokens, server_model

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _strict(response: Response) -> Response:
    """The response validated as the SDK's type (the client itself builds it leniently)."""
    return Response.model_validate(response.to_dict(mode="json"))


def test_text_instructions_logprobs_stream_and_chat_equality(server, openai_client):
    model = server_model(openai_client)
    kwargs = dict(model=model, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=40, temperature=0)
    whole = _strict(openai_client.responses.create(**kwargs))
    assert whole.id.startswith("resp_") and whole.status in ("completed", "incomplete") and whole.object == "response"
    assert "Paris" in whole.output_text and whole.instructions == INSTRUCTIONS
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    assert whole.usage.input_tokens == chat_prompt_tokens(server, messages)
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    # greedy: the same answer as /v1/chat/completions for the same messages
    chat = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.output_tokens == chat.usage.completion_tokens

    # streamed: every event parses as its SDK type, in sequence, and accumulates to the same text
    events = list(openai_client.responses.create(**kwargs, stream=True))
    typed = [EVENTS.validate_python(e.to_dict(mode="json")) for e in events]
    assert [e.sequence_number for e in typed] == list(range(len(typed)))
    kinds = [e.type for e in typed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert {"response.output_text.delta", "response.output_text.done", "response.content_part.done",
            "response.output_item.done"} <= set(kinds)
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta") == whole.output_text
    assert typed[-1].response.output_text == whole.output_text
    assert typed[-1].response.usage.output_tokens == whole.usage.output_tokens
    with openai_client.responses.stream(**kwargs) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == whole.output_text
        assert stream.get_final_response().output_text == whole.output_text

    # logprobs of the output text, greedy: the sampled token is the most likely one
    lp = openai_client.responses.create(**kwargs, include=["message.output_text.logprobs"], top_logprobs=2)
    tokens = lp.output[0].content[0].logprobs
    assert len(tokens) == lp.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in tokens)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in tokens)


def test_forced_tool_round_trip_and_parse(openai_client):
    model = server_model(openai_client)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(model=model, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=40, temperature=0)
    call_response = _strict(openai_client.responses.create(input=ask, **forced))
    [call] = call_response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"city"}

    streamed = [EVENTS.validate_python(e.to_dict(mode="json"))
                for e in openai_client.responses.create(input=ask, stream=True, **forced)]
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    assert [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"] == [call.arguments]

    # the call and its output go back as items; the model answers in text
    follow = _strict(openai_client.responses.create(
        model=model, tools=[WEATHER], max_output_tokens=30, temperature=0,
        input=[*ask, call.to_dict(mode="json"),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}]))
    assert follow.output[-1].type == "message" and follow.output_text
    assert follow.usage.input_tokens > call_response.usage.input_tokens

    class City(BaseModel):
        name: str
        country: str

    parsed = openai_client.responses.parse(model=model, input="Name one city in France.", text_format=City,
                                           max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_previous_response_id_store_background_and_cancel(openai_client):
    model = server_model(openai_client)
    tag = uuid.uuid4().hex[:8]  # a prompt no other test cached
    first = openai_client.responses.create(model=model, input=f"[{tag}] Name a fruit that is red.",
                                           max_output_tokens=16, temperature=0)
    second = openai_client.responses.create(model=model, input="And one that is yellow?", max_output_tokens=16,
                                            temperature=0, previous_response_id=first.id)
    third = openai_client.responses.create(model=model, input="And one that is green?", max_output_tokens=16,
                                           temperature=0, previous_response_id=second.id)
    assert third.previous_response_id == second.id
    # each turn's prompt holds the whole conversation, and its start is read from the prefix cache
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    for before, after in ((first, second), (second, third)):
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens // 16 * 16 > 0
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens_details.cached_tokens

    stored = openai_client.responses.retrieve(first.id)
    assert stored.output_text == first.output_text and stored.status == first.status
    items = openai_client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And one that is yellow?"]
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.responses.create(model=model, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    assert openai_client.responses.retrieve(third.id).output_text == third.output_text  # a stored turn stays

    # background: answered at once, polled to its end; a long one is cancelled and aborted
    quick = openai_client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0,
                                           background=True)
    assert quick.status in ("queued", "in_progress") and quick.background
    long = openai_client.responses.create(model=model, input="Tell me a very long story about a dragon.",
                                          max_output_tokens=4000, background=True, extra_body={"ignore_eos": True})
    cancelled = openai_client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 4000
    assert openai_client.responses.retrieve(long.id).status == "cancelled"
    deadline = time.monotonic() + 60
    while (done := openai_client.responses.retrieve(quick.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sync = openai_client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0)
    assert done.status == sync.status and done.output_text == sync.output_text


@pytest.mark.parametrize("body, status, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     400, "input[0].content[1].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, 400, "tools[0].type"),
    ({"input": [{"type": "local_shell_call_output", "id": "x", "output": "y"}]}, 400, "input[0].type"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
])
def test_errors_name_the_field(server, body, status, param):
    import httpx

    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    r = httpx.get(f"{server.url}/v1/responses/resp_unknown", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
