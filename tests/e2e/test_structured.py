"""End to end: constrained output and tool calls from the real parallm-launch on the default model
(SmolLM2-135M-Instruct: no tool syntax of its own, so the grammar does the work), read by the
official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
from typing import Literal

import openai
import pydantic
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

pytestmark = pytest.mark.e2e

# the bar is 20 of 20 seeds (`make test-slow`); the default suite runs the first 4
SEEDS = [pytest.param(range(4), id="4-seeds"), pytest.param(range(20), id="20-seeds", marks=pytest.mark.slow)]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=130)
    city: Literal["Paris", "London", "Tokyo"]
    nickname: str | None = pydantic.Field(max_length=20)


WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def model_of(client) -> str:
    return client.models.list().data[0].id


def _parallel(fn, seeds):
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, seeds))


@pytest.mark.parametrize("seeds", SEEDS)
def test_parse_gives_a_valid_object_on_every_seed(openai_client, seeds):
    model = model_of(openai_client)
    messages = [{"role": "user", "content": "Describe a person as JSON."}]

    def one(seed):
        out = openai_client.chat.completions.parse(model=model, messages=messages, response_format=Person,
                                                   temperature=1.0, seed=seed, max_tokens=200)
        return out.choices[0]

    choices = _parallel(one, seeds)
    assert all(c.finish_reason == "stop" and isinstance(c.message.parsed, Person) for c in choices)


@pytest.mark.parametrize("seeds", SEEDS)
def test_named_tool_choice_arguments_validate_on_every_seed(openai_client, seeds):
    model = model_of(openai_client)
    messages = [{"role": "user", "content": "What is the weather in Paris this week?"}]
    params = WEATHER["function"]["parameters"]

    def one(seed):
        return openai_client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, SEARCH], temperature=1.0, seed=seed, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]

    for c in _parallel(one, seeds):
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == set(params["required"])
        assert isinstance(args["city"], str) and len(args["city"]) <= 30
        assert args["unit"] in ("celsius", "fahrenheit") and 1 <= args["days"] <= 14


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_streamed_tool_calls_accumulate_to_the_whole_message(openai_client, tool_choice):
    model = model_of(openai_client)
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather in Tokyo?"}], tools=[WEATHER, SEARCH],
              tool_choice=tool_choice, temperature=1.0, seed=7, max_tokens=150)
    whole = openai_client.chat.completions.create(**kw).choices[0]
    state = ChatCompletionStreamState()
    for chunk in openai_client.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_regex_choice_and_logprobs_cover_every_token(openai_client):
    model = model_of(openai_client)
    out = openai_client.completions.create(model=model, prompt="My phone number is", max_tokens=30, temperature=1.0,
                                           seed=3, logprobs=1, extra_body={"structured_outputs": {
                                               "regex": r" \d{3}-\d{4}"}})
    c = out.choices[0]
    assert re.fullmatch(r" \d{3}-\d{4}", c.text) and c.finish_reason == "stop"
    assert len(c.logprobs.token_logprobs) == out.usage.completion_tokens
    chat = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Yes or no?"}],
                                                 extra_body={"guided_choice": ["yes", "no"]}, temperature=1.0)
    assert chat.choices[0].message.content in ("yes", "no")


def test_an_unsupported_schema_keyword_is_a_400_naming_it(openai_client):
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        openai_client.chat.completions.create(
            model=model_of(openai_client), messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "array", "uniqueItems": True}}})


def test_max_tokens_mid_json_is_length_with_the_partial_text(openai_client):
    out = openai_client.chat.completions.create(
        model=model_of(openai_client), messages=[{"role": "user", "content": "JSON please"}], max_tokens=3,
        response_format={"type": "json_object"}, temperature=1.0, seed=1)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content.startswith("{")
