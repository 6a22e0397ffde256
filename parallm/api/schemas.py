"""The OpenAI-compatible request and response bodies, as msgspec Structs.

Decoding a request body into one of these checks every type and range and names the field
that is wrong (see errors.from_validation); cross-field rules live in validate.py.
Unknown request fields are ignored, as OpenAI's own clients send fields a server may not know
(`store`, `metadata`, `reasoning_effort`, ...); docs/openai-api.md lists what is honoured.
Response fields that are extensions (vLLM's `token_ids`, `prompt_token_ids`, `prompt_logprobs`)
default to UNSET, so they are left out of the JSON unless the request asked for them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType


def _d(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


INT32 = 2**31
# Every integer field has its real range: int32 for what the engine takes as int32 (counts, token
# ids), int64 for seeds and client metadata (msgspec's bounds stop at int64).
Int32 = Annotated[int, Meta(ge=-INT32, lt=INT32)]
Count = Annotated[int, Meta(ge=0, lt=INT32)]
TokenId = Count
Int64 = Annotated[int, Meta(ge=-2**63, le=2**63 - 1)]
PRIORITY_DOC = "lower is served first (vLLM's convention); a waiting request ages toward 0, see docs/scheduling.md"

# --------------------------------------------------------------------------- requests

Role = Literal["system", "user", "assistant", "tool", "developer", "function"]


class ImageURL(Struct, kw_only=True):
    url: str
    detail: str | None = None


class ContentPart(Struct, kw_only=True):
    """A part of a message's content: text ("text", "input_text"), or an image ("image_url", "input_image")
    for a vision-language model (docs/vision.md): a data: URL, or an http(s) URL the server may fetch."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(Struct, kw_only=True):
    role: Role
    content: str | list[str | ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None    # an earlier assistant turn's thinking (rendered by the template)
    reasoning: str | None = None


class StreamOptions(Struct, kw_only=True):
    include_usage: Annotated[bool, _d("send a last chunk with the usage of the whole request")] = False


class ResponseFormat(Struct, kw_only=True):
    type: Annotated[str, _d("text, json_object or json_schema (the output then follows json_schema.schema)")]
    json_schema: dict[str, Any] | None = None


Penalty = Annotated[float, _d("in [-2, 2]", ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
NonNegInt = Count


class NotYetSupported(Struct, kw_only=True):
    """Fields that known clients send to change what is generated and that this server does not do
    yet: declared so that a request giving one gets a 400 naming it (validate.check_not_supported)
    instead of having it silently ignored like an unknown field."""

    adapters: Any = None                    # mlx_lm.server: an adapter path per request
    draft_model: Any = None                 # mlx_lm.server: speculative decoding
    num_draft_tokens: Any = None
    xtc_probability: Any = None             # mlx_lm.server: XTC sampling
    xtc_threshold: Any = None
    repetition_context_size: Any = None     # mlx_lm.server: penalties over a window (parallm's cover every token)
    presence_context_size: Any = None
    frequency_context_size: Any = None
    role_mapping: Any = None                # mlx_lm.server: a prompt format for models without a chat template


class SamplingRequest(NotYetSupported, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Annotated[str | None, _d("the served model id (GET /v1/models); omitted: the served model")] = None
    max_tokens: Annotated[int, _d("tokens to generate at most; omitted: the server default", ge=0, lt=INT32)] | None = None
    temperature: Annotated[float, _d("0 = greedy", ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, _d("choices to generate per prompt, at most the engine's max_num_seqs", ge=1, lt=INT32)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _d("stop strings (any number); not included in the output")] = None
    seed: Annotated[int, _d("a signed 64-bit integer", ge=-2**63, le=2**63 - 1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[int, Bias] | None, _d("token id -> bias in [-100, 100]")] = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    structured_outputs: Annotated[dict[str, Any] | None, _d(
        "constrain the output: one of json (a JSON schema), regex, choice (strings), grammar (Lark or GBNF), "
        "json_object")] = None
    guided_json: Annotated[dict[str, Any] | str | None, _d("vLLM < 0.10: structured_outputs.json")] = None
    guided_regex: Annotated[str | None, _d("vLLM < 0.10: structured_outputs.regex")] = None
    guided_choice: Annotated[list[str] | None, _d("vLLM < 0.10: structured_outputs.choice")] = None
    guided_grammar: Annotated[str | None, _d("vLLM < 0.10: structured_outputs.grammar")] = None
    guided_decoding_backend: Annotated[str | None, _d("accepted and ignored (the engine is llguidance)")] = None
    top_k: Annotated[int, _d("keep the k most likely tokens; 0 or -1: off", ge=-1, lt=INT32)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: Annotated[int, _d("tokens generated before eos or a stop may end the sequence", ge=0, lt=INT32)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_special_tokens: Annotated[bool | None, _d("omitted: true for completions, false for chat")] = None
    return_token_ids: Annotated[bool, _d("add prompt_token_ids and token_ids to the response")] = False
    return_tokens_as_token_ids: Annotated[bool, _d("write every logprob token (and top_logprobs key) as "
                                                   "'token_id:<id>'")] = False
    prompt_logprobs: Annotated[int, _d("logprobs of the prompt tokens, with this many alternatives (at most "
                                       "server.max_logprobs)", ge=0, lt=INT32)] | None = None
    priority: Annotated[int, _d(PRIORITY_DOC, ge=-INT32, lt=INT32)] = 0
    # parallm extension
    adapter: Annotated[str, _d("LoRA adapter to generate with ('' = the server's default policy: the base model "
                               "unless an adapter was loaded through /load_adapter or /upload_adapter)")] = ""
    adapter_version: Annotated[int, _d("pin the adapter version (0: the latest when admitted)", ge=0, lt=INT32)] = 0
    min_policy_version: Annotated[int, _d("the adapter version must be at least this (0: any)", ge=0, lt=INT32)] = 0
    max_staleness: Annotated[int, _d("a pinned version may lag the latest by at most this many versions (-1: any)",
                                     ge=-1, lt=INT32)] = -1


PromptItem = str | TokenId | list[TokenId]


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: Annotated[str | list[PromptItem],
                      _d("a string, a list of strings, a list of token ids, or a list of token-id lists; "
                         "a list of several prompts gives n choices per prompt")]
    echo: bool = False
    logprobs: Annotated[int, _d("logprobs of the sampled tokens and this many alternatives (at most "
                                "server.max_logprobs)", ge=0, lt=INT32)] | None = None
    suffix: Annotated[str | None, _d("not supported")] = None
    best_of: Annotated[int, _d("only best_of == n is supported", ge=1, lt=INT32)] | None = None


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, _d("OpenAI's newer name for max_tokens", ge=0, lt=INT32)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, _d("alternatives per token (at most server.max_logprobs)", ge=0, lt=INT32)] | None = None
    tools: Annotated[list[dict[str, Any]] | None, _d("functions the model may call (rendered by the chat template); "
                                                     "tool_choice required or named is enforced by the grammar")] = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[dict[str, Any]] | None, _d("not supported")] = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: exactly one of `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: Annotated[bool | None, _d("omitted: true for a prompt, false for messages")] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[NonNegInt]


# --------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageInfo(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(Struct, kw_only=True):
    """vLLM's prompt logprob entry: one per alternative, keyed by token id."""

    logprob: float | None
    rank: int | None = None           # how many tokens are at least as likely (1 = the most likely), as vLLM
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionChunk(Struct, kw_only=True):
    """One SSE event of a streamed completion (OpenAI streams text_completion objects)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct, kw_only=True):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET              # the model's thinking (vLLM >= 0.19's name)
    reasoning_content: str | UnsetType = UNSET      # the same text under the DeepSeek / older vLLM name


class ChatChoice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class ChatDelta(Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "parallm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class HealthResponse(Struct, kw_only=True):
    """GET /health: 200 when the status is 'ok', 503 otherwise; the backend may add fields."""

    status: Literal["ok", "degraded", "overloaded", "shutting_down"]
