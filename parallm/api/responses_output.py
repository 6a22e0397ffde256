"""A finished (or failed, cancelled) Responses request as the `response` object.

The chat route's answer is read back as output items: the reasoning (a `reasoning` item with the
model's own text as `reasoning_text` content), the answer (a `message` item with one `output_text`
part) and the tool calls (one `function_call` item each). The same builders serve the streamed
events (responses_events.py), so a stream's final `response.completed` equals the non-streamed body.
"""

from __future__ import annotations

import time
from typing import Any

from parallm.api import schemas as chat
from parallm.api.responses_input import ResponsesPlan, new_id
from parallm.api.responses_schemas import (FunctionCall, IncompleteDetails, InputTokensDetails, OutputItem,
                                           OutputMessage, OutputText, OutputTokensDetails, ReasoningItem,
                                           ReasoningText, ResponseError, ResponseObject, ResponseUsage, Status,
                                           TokenLogprob, TopLogprob)
from parallm.api.schemas import ChatMessage


class ReasoningTokens:
    """Counts the output tokens that went to reasoning: those of Outputs that carried thinking text and
    no answer text (a step that carries both counts as answer; the end marker's token as neither)."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, tokens: int, reasoning: str, text: str) -> None:
        if reasoning and not text:
            self.count += tokens


def response_logprobs(items: list[chat.TokenLogprob] | None) -> list[TokenLogprob]:
    def top(a: chat.TopLogprob) -> TopLogprob:
        return TopLogprob(token=a.token, logprob=a.logprob, bytes=a.bytes or list(a.token.encode()))

    return [TokenLogprob(token=t.token, logprob=t.logprob, bytes=t.bytes or list(t.token.encode()),
                         top_logprobs=[top(a) for a in t.top_logprobs])
            for t in items or []]


def status_of(finish: str | None) -> Status:
    status = {"length": "incomplete", "abort": "cancelled"}.get(finish or "stop", "completed")
    return status  # type: ignore[return-value]


def function_call_item(call: dict[str, Any], status: str = "completed") -> FunctionCall:
    fn = call.get("function") or {}
    return FunctionCall(id=new_id("fc"), call_id=call.get("id") or new_id("call"), name=fn.get("name", ""),
                        arguments=fn.get("arguments", ""), status=status)  # type: ignore[arg-type]


def output_items(message: chat.AssistantMessage, logprobs: list[chat.TokenLogprob] | None,
                 finish: str | None) -> list[OutputItem]:
    """A chat choice's message as output items: reasoning, then the answer, then the calls."""
    item_status = "incomplete" if finish == "length" else "completed"
    items: list[OutputItem] = []
    reasoning = message.reasoning if isinstance(message.reasoning, str) else ""
    if reasoning:
        items.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=reasoning)],
                                   status=item_status))  # type: ignore[arg-type]
    if message.content or not (isinstance(message.tool_calls, list) and message.tool_calls):
        text = OutputText(text=message.content or "", logprobs=response_logprobs(logprobs))
        items.append(OutputMessage(id=new_id("msg"), status=item_status, content=[text]))  # type: ignore[arg-type]
    if isinstance(message.tool_calls, list):
        items += [function_call_item(c) for c in message.tool_calls]
    return items


def response_usage(usage: chat.UsageInfo, reasoning_tokens: int) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=usage.completion_tokens,
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                         total_tokens=usage.total_tokens)


def response_object(rp: ResponsesPlan, status: Status, output: list[OutputItem] | None = None,
                    usage: ResponseUsage | None = None, error: ResponseError | None = None) -> ResponseObject:
    """The response object, echoing the request's settings as OpenAI does."""
    req = rp.req
    done = status not in ("queued", "in_progress")
    params = rp.plan.submits[0].spec.params
    body = ResponseObject(
        id=rp.plan.id, created_at=rp.plan.created, status=status, completed_at=int(time.time()) if done else None,
        background=req.background, error=error, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        metadata=dict(req.metadata or {}), model=rp.plan.model, output=list(output or []),
        parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
        reasoning={"effort": req.reasoning.effort, "summary": req.reasoning.summary} if req.reasoning else None,
        store=req.store, temperature=params.temperature, text={"format": (req.text.format if req.text else None)
                                                              or {"type": "text"}},
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto", tools=list(req.tools or []),
        top_logprobs=req.top_logprobs, top_p=params.top_p, usage=usage, user=req.user)
    if status == "incomplete":
        body.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    if req.safety_identifier is not None:
        body.safety_identifier = req.safety_identifier
    if req.prompt_cache_key is not None:
        body.prompt_cache_key = req.prompt_cache_key
    return body


def finished_response(rp: ResponsesPlan, answer: chat.ChatCompletionResponse, reasoning_tokens: int) -> ResponseObject:
    """The response object of a whole chat answer (choice 0)."""
    choice = answer.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None else None
    items = output_items(choice.message, content, choice.finish_reason)
    usage = response_usage(answer.usage, reasoning_tokens) if answer.usage is not None else None
    return response_object(rp, status_of(choice.finish_reason), items, usage)


def output_messages(output: list[OutputItem]) -> list[ChatMessage]:
    """A response's output as the chat messages a continuing response (previous_response_id) sends
    the template: one assistant message with its reasoning, text and tool calls."""
    msg = ChatMessage(role="assistant", content="")  # "" with tool calls too (see responses_input._last_assistant)
    for item in output:
        if isinstance(item, ReasoningItem):
            msg.reasoning_content = "".join(c.text for c in item.content)
        elif isinstance(item, OutputMessage):
            msg.content = "".join(c.text for c in item.content)
        elif isinstance(item, FunctionCall):
            msg.tool_calls = [*(msg.tool_calls or []), {"id": item.call_id, "type": "function",
                                                         "function": {"name": item.name, "arguments": item.arguments}}]
    return [msg]
