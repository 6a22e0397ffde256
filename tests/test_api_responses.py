"""The Responses API's translation (parallm/api/responses_*.py): input items to chat messages, the
request to the chat route's Plan, and output items checked against the openai package's own types."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types.responses import Response

from parallm.api import schemas as chat
from parallm.api.errors import APIError
from parallm.api.responses_input import items_to_messages, responses_plan
from parallm.api.responses_output import finished_response, output_messages
from parallm.api.responses_schemas import InputItem, ResponsesRequest
from parallm.api.validate import Limits, decode

LIMITS = Limits(model_name="m", max_model_len=4096)


def request(**body) -> ResponsesRequest:
    return decode(json.dumps({"model": "m", **body}).encode(), ResponsesRequest)


def items(*raw) -> list[InputItem]:
    return msgspec.convert(list(raw), list[InputItem])


def test_string_input_and_instructions_are_the_chat_messages():
    rp = responses_plan(request(input="Hi", instructions="Be brief.", max_output_tokens=9, temperature=0), LIMITS)
    submit = rp.plan.submits[0]
    assert submit.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert submit.spec.params.max_tokens == 9 and submit.spec.params.temperature == 0
    assert rp.plan.id.startswith("resp_") and submit.rid == rp.plan.id
    assert [m.role for m in rp.messages] == ["user"]  # instructions are not carried to a continuing response
    assert rp.input_items[0]["type"] == "message" and rp.input_items[0]["content"][0]["text"] == "Hi"


def test_a_tool_round_trip_becomes_one_assistant_message_and_a_tool_message():
    msgs = items_to_messages(items(
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}))
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assistant = msgs[1]
    assert assistant.content == "Let me look." and assistant.reasoning_content == "think"
    assert assistant.tool_calls == [{"id": "call_1", "type": "function",
                                     "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]
    assert (msgs[2].tool_call_id, msgs[2].name, msgs[2].content) == ("call_1", "weather", "sunny")


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x", "detail": "max"}]}]},
     "input[0].content[0].detail"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"},
                                             {"type": "input_file", "file_id": "file-1"}]}]},
     "input[0].content[1].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image",
                                                                            "image_url": "data:,x"}]}]},
     "input[0].output[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"not": {}}}}},
     "text.format"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as err:
        responses_plan(request(**body), LIMITS)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert param.split("[")[0].split(".")[0] in err.value.message


def test_input_images_become_the_chat_routes_image_parts_and_their_errors_name_the_input():
    """input_image parts reach the tokenizer stage in place among the text parts; an error it reports for
    `messages[k]` names the input item (after the instructions and a continued conversation) instead."""
    from parallm.api.backend import BackendError

    content = [{"type": "input_text", "text": "Compare"}, {"type": "input_image", "image_url": "data:,a"},
               {"type": "input_image", "image_url": "https://h/b.png", "detail": "low"}]
    history = [chat.ChatMessage(role="user", content="Hi"), chat.ChatMessage(role="assistant", content="Hello")]
    rp = responses_plan(request(input=[{"role": "user", "content": content}], instructions="Be brief."), LIMITS,
                        history)
    assert rp.plan.submits[0].messages[3]["content"] == [
        {"type": "text", "text": "Compare"}, {"type": "input_image", "image_url": {"url": "data:,a"}},
        {"type": "input_image", "image_url": {"url": "https://h/b.png"}}]
    assert rp.input_items[0]["content"][2] == {"type": "input_image", "image_url": "https://h/b.png",
                                               "file_id": None, "detail": "low"}
    err = rp.renamed(BackendError(400, "invalid_request_error", "messages[3].content[2]: the image URL could not be "
                                  "fetched", "messages[3].content[2].image_url"))
    assert (err.param, err.message) == ("input[0].content[2].image_url",
                                        "input[0].content[2]: the image URL could not be fetched")
    err = rp.renamed(BackendError(400, "invalid_request_error", "messages[1].content[0]: x", "messages[1].content[0]"))
    assert err.param == "previous_response_id" and err.message.startswith("the conversation of previous_response_id's "
                                                                          "messages[0].content[0]")
    assert rp.renamed(BackendError(400, "invalid_request_error", "too long", "messages")).param == "input"
    plain = responses_plan(request(input=[{"role": "user", "content": content[:1]}]), LIMITS)
    assert plain.plan.submits[0].messages[0]["content"] == "Compare"  # text only: a string, as before


def test_tools_tool_choice_and_text_format_use_the_chat_constraints():
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object",
                                                                  "properties": {"city": {"type": "string"}}}}
    rp = responses_plan(request(input="x", tools=[tool], tool_choice={"type": "function", "name": "weather"}), LIMITS)
    assert rp.plan.tools.mode == "named" and rp.plan.tools.name == "weather"
    assert json.loads(rp.plan.submits[0].spec.params.constraint.value) == tool["parameters"]
    assert rp.plan.submits[0].chat_template_kwargs["tools"][0]["function"]["name"] == "weather"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rp = responses_plan(request(input="x", text={"format": {"type": "json_schema", "name": "A", "schema": schema}}),
                        LIMITS)
    c = rp.plan.submits[0].spec.params.constraint
    assert c.kind == "json_schema" and json.loads(c.value) == schema
    rp = responses_plan(request(input="x", include=["message.output_text.logprobs"], top_logprobs=3), LIMITS)
    assert rp.plan.logprobs == 3 and rp.plan.submits[0].spec.params.top_logprobs == 3
    rp = responses_plan(request(input="x", reasoning={"effort": "none"}), LIMITS)
    assert rp.plan.submits[0].chat_template_kwargs == {"enable_thinking": False}


def _answer(message: chat.AssistantMessage, finish: str, logprobs=None) -> chat.ChatCompletionResponse:
    return chat.ChatCompletionResponse(
        id="x", created=1, model="m",
        choices=[chat.ChatChoice(index=0, message=message, finish_reason=finish,
                                 logprobs=chat.ChatLogprobs(content=logprobs) if logprobs else None)],
        usage=chat.UsageInfo(prompt_tokens=10, completion_tokens=6, total_tokens=16,
                             prompt_tokens_details=chat.PromptTokensDetails(cached_tokens=8)))


def _validated(body) -> Response:
    """The body as the openai package's Response, validated strictly (not constructed leniently)."""
    return Response.model_validate(json.loads(msgspec.json.encode(body)))


def test_output_items_validate_as_the_sdk_response():
    rp = responses_plan(request(input="x", metadata={"k": "v"}, include=["message.output_text.logprobs"]), LIMITS)
    lp = [chat.TokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105],
                            top_logprobs=[chat.TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105])])]
    message = chat.AssistantMessage(content="Hi")
    message.reasoning = "hmm"
    body = finished_response(rp, _answer(message, "stop", lp), reasoning_tokens=3)
    sdk = _validated(body)
    assert [o.type for o in sdk.output] == ["reasoning", "message"]
    assert sdk.output_text == "Hi" and sdk.output[1].content[0].logprobs[0].token == "Hi"
    assert sdk.output[0].content[0].text == "hmm"
    assert (sdk.usage.input_tokens_details.cached_tokens, sdk.usage.output_tokens_details.reasoning_tokens) == (8, 3)
    assert sdk.status == "completed" and sdk.metadata == {"k": "v"}
    assert output_messages(body.output)[0].content == "Hi"

    calls = chat.AssistantMessage(content=None)
    calls.tool_calls = [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    sdk = _validated(finished_response(rp, _answer(calls, "tool_calls"), 0))
    assert [(o.type, o.call_id, o.name) for o in sdk.output] == [("function_call", "call_9", "f")]
    cut = _validated(finished_response(rp, _answer(chat.AssistantMessage(content="He"), "length"), 0))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


# --------------------------------------------------------------------------- the routes, over a scripted backend

def _client(**server):
    from starlette.testclient import TestClient

    from parallm.api.app import build_app
    from parallm.config import ServerConfig
    from test_api_fakes import FakeBackend

    backend = FakeBackend()
    return TestClient(build_app(backend, ServerConfig(**server))), backend


def _events(text: str) -> list[dict]:
    """The SSE events of a body, each checked to be `event: <type>` over data of that type."""
    out = []
    for block in text.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def test_route_stream_events_parse_as_the_sdk_types_and_end_as_the_whole_response():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    client, _ = _client()
    whole = client.post("/v1/responses", json={"input": "hi"}).json()
    assert Response.model_validate(whole).output_text == "Hello world"
    r = client.post("/v1/responses", json={"input": "hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "Hello world"
    final = parsed[-1].response
    assert final.output_text == whole["output"][0]["content"][0]["text"] and final.status == whole["status"]
    assert client.get(f"/v1/responses/{final.id}").json()["output"][0]["content"][0]["text"] == "Hello world"


def test_store_is_bounded_lru_and_get_delete_answer_404_after():
    client, _ = _client(responses_store_max=2)
    ids = [client.post("/v1/responses", json={"input": f"q{i}"}).json()["id"] for i in range(3)]
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404  # evicted (least recently used)
    assert client.get(f"/v1/responses/{ids[1]}").status_code == 200
    client.post("/v1/responses", json={"input": "q3"})                 # evicts ids[2]: ids[1] was used since
    assert client.get(f"/v1/responses/{ids[2]}").status_code == 404
    assert client.get(f"/v1/responses/{ids[1]}").status_code == 200
    r = client.post("/v1/responses", json={"input": "again", "previous_response_id": ids[0]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert client.delete(f"/v1/responses/{ids[1]}").json() == {"id": ids[1], "object": "response", "deleted": True}
    gone = client.get(f"/v1/responses/{ids[1]}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    assert client.post("/v1/responses", json={"input": "x", "store": False}).status_code == 200
    small, _ = _client(responses_store_mb=0, responses_store_max=1000)
    assert small.get(f"/v1/responses/{small.post('/v1/responses', json={'input': 'x'}).json()['id']}").status_code == 200


def test_previous_response_id_sends_the_conversation_and_input_items_list():
    client, backend = _client()
    first = client.post("/v1/responses", json={"input": "one", "instructions": "Be brief."}).json()
    client.post("/v1/responses", json={"input": [{"role": "user", "content": "two"}],
                                       "previous_response_id": first["id"]})
    assert backend.submits[-1].messages == [{"role": "user", "content": "one"},
                                            {"role": "assistant", "content": "Hello world"},
                                            {"role": "user", "content": "two"}]
    items = client.get(f"/v1/responses/{first['id']}/input_items").json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["one"] and items["has_more"] is False


def test_background_cancel_aborts_the_generation():
    from test_api_fakes import FakeBackend

    from parallm.api.app import build_app
    from parallm.config import ServerConfig
    from starlette.testclient import TestClient

    backend = FakeBackend(hang_after=1)
    with TestClient(build_app(backend, ServerConfig())) as client:
        queued = client.post("/v1/responses", json={"input": "x", "background": True}).json()
        assert queued["status"] == "queued" and queued["background"] is True
        cancelled = client.post(f"/v1/responses/{queued['id']}/cancel").json()
        assert cancelled["status"] == "cancelled"
        assert client.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
        assert backend.closed  # the backend iterator was closed: the request aborted in the engine
        backend.hang_after = None
        done = client.post("/v1/responses", json={"input": "y"}).json()
        r = client.post(f"/v1/responses/{done['id']}/cancel")
        assert r.status_code == 400 and "background" in r.json()["error"]["message"]


def _thinking_script(fail: bool = False):
    from parallm.api.backend import BackendError
    from parallm.protocol import Output, Usage, pack_ids

    def script(submit):
        outs = [Output(rid=submit.rid, token_ids=pack_ids([5]), reasoning="Let me "),
                Output(rid=submit.rid, token_ids=pack_ids([6]), reasoning="think."),
                Output(rid=submit.rid, token_ids=pack_ids([7])),  # the end marker: neither
                Output(rid=submit.rid, token_ids=pack_ids([8]), text="Paris")]
        if fail:
            return [*outs[:2], BackendError(503, "stage_restarted", "The engine restarted.", retryable=True)]
        outs.append(Output(rid=submit.rid, token_ids=pack_ids([9]), text=".", finish_reason="stop",
                           usage=Usage(prompt_tokens=4, completion_tokens=5)))
        return outs

    return script


def test_reasoning_is_its_own_item_streamed_or_not_and_a_failure_mid_stream_is_error_then_failed():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter
    from starlette.testclient import TestClient

    from parallm.api.app import build_app
    from parallm.config import ServerConfig
    from test_api_fakes import FakeBackend

    client = TestClient(build_app(FakeBackend(script=_thinking_script()), ServerConfig()))
    whole = Response.model_validate(client.post("/v1/responses", json={"input": "hi"}).json())
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Let me think." and whole.output_text == "Paris."
    assert whole.usage.output_tokens_details.reasoning_tokens == 2 and whole.status == "completed"
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(e) for e in _events(client.post("/v1/responses",
                                                                      json={"input": "hi", "stream": True}).text)]
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_text.delta") == 2 and kinds[-1] == "response.completed"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "Paris."
    assert final.usage.output_tokens_details.reasoning_tokens == 2

    broken = TestClient(build_app(FakeBackend(script=_thinking_script(fail=True)), ServerConfig()))
    events = [adapter.validate_python(e) for e in _events(broken.post("/v1/responses",
                                                                      json={"input": "hi", "stream": True}).text)]
    assert [e.type for e in events[-3:]] == ["response.output_item.done", "error", "response.failed"]
    assert events[-2].code == "stage_restarted" and events[-1].response.status == "failed"
    assert broken.get(f"/v1/responses/{events[-1].response.id}").json()["status"] == "failed"


def test_a_background_response_cancelled_before_it_started_releases_its_slot():
    import asyncio

    from parallm.api.generation import GenerationRoutes
    from parallm.api.responses_routes import ResponsesRoutes
    from parallm.config import ServerConfig
    from test_api_fakes import FakeBackend

    async def scenario():
        backend = FakeBackend(hang_after=0)
        gen = GenerationRoutes(backend, ServerConfig())
        routes = ResponsesRoutes(backend, ServerConfig(), gen)
        rp = responses_plan(ResponsesRequest(input="x", background=True), gen.limits())
        gen.gate.enter()
        routes._background(rp)
        task = routes.store.get(rp.plan.id).task
        task.cancel()  # before its first step: _run's body never runs
        await asyncio.wait([task])
        await asyncio.sleep(0)
        return gen.gate.in_flight, routes.store.get(rp.plan.id).response.status, backend.submits

    assert asyncio.run(scenario()) == (0, "cancelled", [])
