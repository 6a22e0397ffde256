"""Checked OpenAI requests to protocol messages: a `Plan` holding one TextSubmit per prompt.

The Plan also carries what building the response needs (ids, what was asked for), so
outputs.py and sse.py never look at the request again. Choice `i * n + j` of a response is
sample j of prompt i, as in OpenAI's and vLLM's batched completions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from parallm.api.adapters import adapter_of
from parallm.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest
from parallm.api.structured import ToolPlan, constraint_of, tool_plan
from parallm.api.validate import Limits, check_chat, check_completion, stop_strings
from parallm.protocol import Constraint, DetokSpec, RequestSpec, SamplingParams, TextSubmit, pack_ids

SYSTEM_FINGERPRINT = "fp_parallm"


def new_id(kind: Literal["completion", "chat"]) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


@dataclass
class Plan:
    """One HTTP generation request: what goes to the backend and how to answer."""

    kind: Literal["completion", "chat"]
    id: str
    model: str
    submits: list[TextSubmit]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None        # alternatives per token when logprobs are wanted, else None
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (alternatives per prompt token)
    echo: bool = False                  # completions: prepend the prompt (and its logprobs)
    echo_only: bool = False             # echo with max_tokens=0: the one generated token is dropped
    return_token_ids: bool = False
    tokens_as_ids: bool = False         # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    tools: ToolPlan | None = None       # chat: how the output becomes tool calls
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = SYSTEM_FINGERPRINT

    @property
    def num_choices(self) -> int:
        return self.n * len(self.submits)


def sampling_params(req: SamplingRequest, max_tokens: int, top_logprobs: int | None,
                    prompt_logprobs: int | None, tool_constraint: Constraint | None = None,
                    defaults: Mapping[str, float] | None = None, max_constraint_bytes: int = 0) -> SamplingParams:
    """OpenAI/vLLM sampling fields to SamplingParams. A field the request omits takes `defaults`' value
    (the model's generation_config.json: Limits.sampling_defaults), else the protocol's default."""
    p = SamplingParams(**(defaults or {}), max_tokens=max_tokens, min_tokens=req.min_tokens,
                       ignore_eos=req.ignore_eos, seed=req.seed, logprobs=top_logprobs is not None,
                       top_logprobs=top_logprobs or 0,
                       prompt_logprobs=prompt_logprobs, constraint=constraint_of(req, tool_constraint,
                                                                         max_bytes=max_constraint_bytes))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            setattr(p, name, float(value))
    if req.top_k is not None:
        p.top_k = max(0, req.top_k)
    if req.logit_bias:
        p.logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
    if req.stop_token_ids:
        p.stop_token_ids = list(req.stop_token_ids)
    return p


def detok_spec(req: SamplingRequest, *, token_strings: bool, prompt_info: bool) -> DetokSpec:
    return DetokSpec(stop=stop_strings(req.stop), include_stop_str=req.include_stop_str_in_output,
                     skip_special_tokens=req.skip_special_tokens, token_strings=token_strings, echo=prompt_info)


def _metadata(request_id: str, user: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"request_id": request_id}
    if user:
        meta["user"] = user
    return meta


def request_spec(req: Any, params: SamplingParams, detok: DetokSpec, *, adapter: str,
                 metadata: dict[str, Any]) -> RequestSpec:
    """The RequestSpec of a checked HTTP request (any route): the one place that reads the request
    fields every route shares (n, priority, the adapter version requirements)."""
    return RequestSpec(params=params, n=req.n, detok=detok, adapter=adapter, adapter_version=req.adapter_version,
                       min_version=req.min_policy_version, max_staleness=req.max_staleness, priority=req.priority,
                       metadata=metadata, submitted_at=time.time())


def completion_plan(req: CompletionRequest, limits: Limits, request_id: str = "") -> Plan:
    """Check a completion request and build its Plan (raises errors.APIError)."""
    prompts, max_tokens = check_completion(req, limits)
    rid = new_id("completion")
    echo_only = req.echo and max_tokens == 0
    prompt_lp = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lp = max(prompt_lp or 0, req.logprobs)
    params = sampling_params(req, max(1, max_tokens), req.logprobs, prompt_lp, defaults=limits.sampling_defaults,
                             max_constraint_bytes=limits.max_constraint_bytes)
    detok = detok_spec(req, token_strings=req.logprobs is not None or prompt_lp is not None,
                       prompt_info=req.echo or req.return_token_ids or prompt_lp is not None)
    spec = request_spec(req, params, detok, adapter=adapter_of(req.model, req.adapter, limits.model_name),
                        metadata=_metadata(request_id or rid, req.user))
    submits = []
    for i, prompt in enumerate(prompts):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, pack_ids(prompt))
        submits.append(TextSubmit(
            rid=rid if len(prompts) == 1 else f"{rid}-{i}", reply_to=b"", spec=spec, prompt=text, prompt_ids=ids,
            add_special_tokens=True if req.add_special_tokens is None else req.add_special_tokens))
    return Plan("completion", rid, limits.model_name, submits, n=req.n, stream=req.stream,
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs, echo=req.echo,
                echo_only=echo_only, return_token_ids=req.return_token_ids,
                tokens_as_ids=req.return_tokens_as_token_ids)


def _part_dict(part: Any) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if part.image_url is not None:
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        return {"type": part.type, "image_url": {"url": url}}  # the type as sent: errors name it
    return {"type": "text", "text": part.text or ""}


def message_dict(msg: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it: text content, `developer` read as `system`."""
    content = msg.content
    if isinstance(content, list) and any(not isinstance(p, str) and p.image_url is not None for p in content):
        content = [_part_dict(part) for part in content]  # images: the tokenizer stage reads the parts
    elif isinstance(content, list):
        content = "\n".join(part if isinstance(part, str) else part.text or "" for part in content)
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
    reasoning = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning  # what Qwen3 / DeepSeek / GLM templates read
    for name in ("name", "tool_calls", "tool_call_id"):
        value = getattr(msg, name)
        if value is not None:
            out[name] = value
    return out


def chat_plan(req: ChatCompletionRequest, limits: Limits, request_id: str = "") -> Plan:
    """Check a chat request and build its Plan (raises errors.APIError)."""
    max_tokens = check_chat(req, limits)
    rid = new_id("chat")
    top = (req.top_logprobs or 0) if req.logprobs else None
    tools, tool_constraint = tool_plan(req)
    params = sampling_params(req, max_tokens, top, req.prompt_logprobs, tool_constraint, limits.sampling_defaults,
                             limits.max_constraint_bytes)
    if params.constraint is not None and thinking_on(req.chat_template_kwargs):
        params.constraint.after_reasoning = True  # the model thinks first; the answer is constrained
    detok = detok_spec(req, token_strings=top is not None or req.prompt_logprobs is not None,
                       prompt_info=req.return_token_ids or req.prompt_logprobs is not None)
    detok.assistant = True
    if tools is not None and tools.mode == "auto":
        detok.tool_parser, detok.tools = limits.tool_parser or "auto", list(req.tools or [])
    spec = request_spec(req, params, detok, adapter=adapter_of(req.model, req.adapter, limits.model_name),
                        metadata=_metadata(request_id or rid, req.user))
    submit = TextSubmit(
        rid=rid, reply_to=b"", spec=spec, messages=[message_dict(m) for m in req.messages],
        add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
        chat_template_kwargs=_template_kwargs(req), add_special_tokens=bool(req.add_special_tokens))
    return Plan("chat", rid, limits.model_name, [submit], n=req.n, stream=req.stream,
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                logprobs=top, prompt_logprobs=req.prompt_logprobs, return_token_ids=req.return_token_ids,
                tokens_as_ids=req.return_tokens_as_token_ids, tools=tools)


def thinking_on(kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a chat request lets the model think (chat_template_kwargs enable_thinking, or the
    `thinking` some templates read, not false): its constraint then begins after the reasoning."""
    kwargs = kwargs or {}
    return kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs, with the request's tools for templates that render them."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.tools
    return kwargs
