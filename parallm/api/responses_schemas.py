"""The OpenAI Responses API's bodies (`/v1/responses`), as msgspec Structs.

Shapes follow the `openai` package's `openai.types.responses` (checked against openai 3.57.0;
docs/openai-api.md lists every field). The request keeps input items loosely typed (`type`
decides which fields matter) so that responses_input.py can name the offending item and field;
what a known client sends and this server cannot do is declared in `ResponsesNotSupported` and
refused by name, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from parallm.api.schemas import INT32, PRIORITY_DOC, Penalty, _d


class InputPart(Struct, kw_only=True):
    """A content part: input_text / output_text (text), or input_image (`image_url`: a data: URL or an
    http(s) URL, for a vision-language model: docs/vision.md); anything else is refused by its type."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: Annotated[str | None, _d("not supported: a 400 unless null (this server keeps no files)")] = None
    detail: Annotated[str | None, _d("auto, low, high or original; accepted, the checkpoint's image processor "
                                     "decides the resolution")] = None


class InputItem(Struct, kw_only=True):
    """One item of `input`: a message (`type` "message" or omitted, with `role`), a function_call, a
    function_call_output or a reasoning item. Output items of an earlier response may be sent back as
    they came."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[dict[str, Any]] | None = None


class TextConfig(Struct, kw_only=True):
    format: Annotated[dict[str, Any] | None,
                      _d("{type: text | json_object | json_schema (name, schema, strict)}")] = None
    verbosity: Annotated[str | None, _d("not supported: a 400 unless null")] = None


class ReasoningConfig(Struct, kw_only=True):
    effort: Annotated[str | None, _d("given to the chat template as reasoning_effort; 'none' turns thinking off "
                                     "(enable_thinking: false)")] = None
    summary: Annotated[str | None, _d("accepted; the reasoning item carries the model's own text, summary stays "
                                      "empty")] = None
    generate_summary: str | None = None


class StreamOptions(Struct, kw_only=True):
    include_obfuscation: Annotated[bool | None, _d("accepted; events carry no obfuscation field")] = None


class ResponsesNotSupported(Struct, kw_only=True):
    """Request fields OpenAI's clients may send that change what is generated and that this server does
    not do: a 400 naming the field unless absent or null."""

    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None


class ResponsesRequest(ResponsesNotSupported, kw_only=True):
    """POST /v1/responses."""

    model: Annotated[str | None, _d("the served model id (or a loaded adapter); omitted: the served model")] = None
    input: Annotated[str | list[InputItem], _d("a string (one user message) or a list of items")] = ""
    instructions: Annotated[str | None, _d("a system message first; not carried to a continuing response")] = None
    max_output_tokens: Annotated[int, _d("tokens to generate at most, reasoning included",
                                         ge=1, lt=INT32)] | None = None
    temperature: Annotated[float, _d("0 = greedy", ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[dict[str, Any]] | None, _d("function tools {type: function, name, parameters, "
                                                     "description, strict}; built-in tools are a 400")] = None
    tool_choice: Annotated[str | dict[str, Any] | None, _d("none, auto, required or {type: function, name}")] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[str] | None, _d("message.output_text.logprobs; reasoning.encrypted_content is accepted "
                                            "(no encrypted content is made)")] = None
    top_logprobs: Annotated[int, _d("alternatives per output token (with include message.output_text.logprobs)",
                                    ge=0, le=20)] | None = None
    metadata: Annotated[dict[str, str] | None, _d("up to 16 pairs, keys <= 64 and values <= 512 characters; "
                                                  "echoed")] = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: Annotated[str | None, _d("accepted; the prefix cache needs no key")] = None
    service_tier: Annotated[str | None, _d("accepted; answered as 'default'")] = None
    store: Annotated[bool, _d("keep the response for GET, previous_response_id and input_items (bounded, "
                              "least recently used evicted first)")] = True
    previous_response_id: Annotated[str | None, _d("continue from a stored response: its input and output come "
                                                   "before this input")] = None
    background: Annotated[bool, _d("answer at once (status queued) and generate on; poll GET, cancel with "
                                   "POST /v1/responses/{id}/cancel; needs store")] = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncation: Annotated[Literal["disabled", "auto"] | None, _d("only disabled (a prompt past the context is "
                                                                 "a 400)")] = None
    # extensions (vLLM's sampling names)
    seed: Annotated[int, _d("a signed 64-bit integer", ge=-2**63, le=2**63 - 1)] | None = None
    top_k: Annotated[int, _d("keep the k most likely tokens; 0 or -1: off", ge=-1, lt=INT32)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: Annotated[str | list[str] | None, _d("stop strings; not included in the output")] = None
    ignore_eos: bool = False
    priority: Annotated[int, _d(PRIORITY_DOC, ge=-INT32, lt=INT32)] = 0


# --------------------------------------------------------------------------- the response object

class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class OutputText(Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[TokenLogprob] = []


class ReasoningText(Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = []


class FunctionCall(Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class ReasoningItem(Struct, kw_only=True, tag="reasoning", tag_field="type"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: ItemStatus = "completed"


OutputItem = OutputMessage | FunctionCall | ReasoningItem


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: Annotated[int, _d("prompt tokens read from the prefix cache")] = 0
    cache_write_tokens: Annotated[int, _d("always 0: cache writes are not counted")] = 0


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(Struct, kw_only=True):
    reason: Literal["max_output_tokens", "content_filter"]


Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponseObject(Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    completed_at: int | None = None
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = {}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None | UnsetType = UNSET
    prompt_cache_key: str | None | UnsetType = UNSET


class DeletedResponse(Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(Struct, kw_only=True):
    """GET /v1/responses/{id}/input_items: the items given as input (with ids), most recent first by default."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
