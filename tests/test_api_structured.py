"""Constrained output and tool calls on the OpenAI routes, read by the official openai client
(in-process, a scripted backend: the engine's side is tests/test_constraints.py and the e2e test)."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.config import ServerConfig
from test_api_fakes import MODEL, FakeBackend, words_script

CHAT = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def client_for(words: list[str], finish: str = "stop") -> tuple[openai.OpenAI, FakeBackend]:
    backend = FakeBackend(script=words_script(words, finish=finish))
    http = TestClient(build_app(backend, ServerConfig()), base_url="http://test")
    return openai.OpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0), backend


class City(pydantic.BaseModel):
    name: str
    population: int


def test_parse_with_a_pydantic_model_sends_its_schema_and_parses_the_content():
    client, backend = client_for(['{"name": ', '"Paris", ', '"population": 2100000}'])
    out = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=City)
    assert out.choices[0].message.parsed == City(name="Paris", population=2100000)
    c = backend.submits[0].spec.params.constraint
    assert c.kind == "json_schema" and json.loads(c.value)["required"] == ["name", "population"]


def test_a_chat_constraint_begins_after_the_reasoning_unless_thinking_is_off():
    client, backend = client_for(['{"name": "Paris", "population": 1}'])
    client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=City)
    client.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="required")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=City, extra_body=off)
    client.completions.create(model=MODEL, prompt="x", extra_body={"guided_json": {"type": "object"}})
    assert [s.spec.params.constraint.after_reasoning for s in backend.submits] == [True, True, False, False]


def test_json_object_and_length_mid_json():
    client, backend = client_for(['{"a"'], finish="length")
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=City)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content == '{"a"'
    assert backend.submits[-1].spec.params.constraint.kind == "json_object"


def _accumulate(stream) -> openai.types.chat.ParsedChatCompletion:
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    return state.get_final_completion()


@pytest.mark.parametrize("parallel", [True, False])
def test_named_tool_choice_streamed_and_not(parallel):
    words = ['{"city": ', '"Paris"', '}']
    client, backend = client_for(words)
    kw = dict(model=MODEL, messages=CHAT, tools=[WEATHER, TIME], parallel_tool_calls=parallel,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    spec = backend.submits[0]
    assert json.loads(spec.spec.params.constraint.value) == WEATHER["function"]["parameters"]
    assert spec.chat_template_kwargs["tools"] == [WEATHER, TIME]  # rendered by the model's template
    streamed = _accumulate(client.chat.completions.create(**kw, stream=True)).choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.type, c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.type, c.function.name, c.function.arguments) for c in msg.tool_calls]


def test_required_tool_choice_gives_every_call_streamed_and_not():
    calls = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    text = json.dumps(calls)
    client, backend = client_for([text[:10], text[10:30], text[30:]])
    kw = dict(model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required")
    whole = client.chat.completions.create(**kw).choices[0]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert whole.finish_reason == "tool_calls" and got == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    schema = json.loads(backend.submits[0].spec.params.constraint.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    streamed = _accumulate(client.chat.completions.create(**kw, stream=True)).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == got
    client.chat.completions.create(**kw, parallel_tool_calls=False)
    assert json.loads(backend.submits[-1].spec.params.constraint.value)["maxItems"] == 1


def test_auto_and_none_send_no_constraint_and_keep_text():
    client, backend = client_for(["Hello"])
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice=choice)
        assert out.choices[0].message.content == "Hello" and out.choices[0].message.tool_calls is None
        assert backend.submits[-1].spec.params.constraint is None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object", "if": {}, "then": {}}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_and_constraint_requests_are_400s(body, param):
    client, backend = client_for(["x"])
    with pytest.raises(openai.BadRequestError) as info:
        known = {k: v for k, v in body.items() if k != "structured_outputs"}
        extra = {"structured_outputs": body["structured_outputs"]} if "structured_outputs" in body else None
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra, **known)
    assert info.value.body["param"] == param, info.value.body
    assert not backend.submits


def _assistant_script(pieces):
    """Outputs as the detokenizer sends them for a model with thinking and its own tool syntax."""
    from parallm.protocol import Output, Usage, pack_ids

    def script(submit):
        assert submit.spec.detok.assistant and submit.spec.detok.tool_parser == "auto"
        outs = []
        for k, (reasoning, text, calls, deltas) in enumerate(pieces):
            last = k == len(pieces) - 1
            outs.append(Output(rid=submit.rid, token_ids=pack_ids([100 + k]), text=text, reasoning=reasoning,
                               tool_calls=calls, tool_call_deltas=deltas, finish_reason="stop" if last else None,
                               usage=Usage(prompt_tokens=3, completion_tokens=len(pieces)) if last else None))
        return outs
    return script


def test_auto_tool_calls_and_reasoning_streamed_and_not():
    call = lambda i, city: {"id": f"chatcmpl-tool-{i}", "type": "function",  # noqa: E731
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    # as the detokenizer sends them: the first call streamed (name, then argument pieces), the second whole
    pieces = [("The user", "", [], []), (" wants weather.", "", [], []), ("", "Checking.", [], []),
              ("", "", [], [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                             "function": {"name": "get_weather", "arguments": ""}}]),
              ("", "", [], [{"index": 0, "function": {"arguments": '{"city": '}}]),
              ("", "", [call(1, "Paris")], [{"index": 0, "function": {"arguments": '"Paris"}'}}]),
              ("", "", [call(2, "Lyon")], [{"index": 1, **call(2, "Lyon")}])]
    backend = FakeBackend(script=_assistant_script(pieces))
    http = TestClient(build_app(backend, ServerConfig()), base_url="http://test")
    client = openai.OpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    kw = dict(model=MODEL, messages=CHAT, tools=[WEATHER])
    whole = client.chat.completions.create(**kw).choices[0]
    extra = whole.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == "The user wants weather."
    assert whole.message.content == "Checking." and whole.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in whole.message.tool_calls] == ["Paris", "Lyon"]
    streamed = _accumulate(client.chat.completions.create(**kw, stream=True)).choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Checking."
    assert streamed.message.model_extra["reasoning"] == "The user wants weather."
    assert [(c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.id, c.function.name, c.function.arguments) for c in whole.message.tool_calls]
