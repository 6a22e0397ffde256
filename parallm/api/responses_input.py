"""A Responses API request to the chat route's Plan: input items to chat messages, fields to theirs.

The request becomes a `ChatCompletionRequest` and goes through `chat_plan`, so the chat template,
constrained decoding (tool_choice, text.format), reasoning parsing and logprobs are the chat
route's own, and greedy output equals /v1/chat/completions for the same messages. An error the
chat checks raise names the Responses field (`max_output_tokens`, `text.format`, ...); so does an
error the tokenizer stage reports for a message's image (`ResponsesPlan.renamed`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from parallm.api.backend import BackendError
from parallm.api.errors import APIError, invalid
from parallm.api.responses_schemas import InputItem, InputPart, ResponsesNotSupported, ResponsesRequest
from parallm.api.schemas import ChatCompletionRequest, ChatMessage, ContentPart, ImageURL, ResponseFormat
from parallm.api.translate import Plan, chat_plan
from parallm.api.validate import Limits, unsupported

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
REASONING_PART_TYPES = ("reasoning_text", "text")
IMAGE_PART = "input_image"
IMAGE_DETAILS = ("auto", "low", "high", "original")
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_ACCEPTED = (INCLUDE_LOGPROBS, "reasoning.encrypted_content")
MAX_METADATA = 16


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesPlan:
    """A checked Responses request: the chat Plan that generates it and what the answer echoes."""

    plan: Plan
    req: ResponsesRequest
    messages: list[ChatMessage]       # the whole conversation sent to the template, instructions excluded
    input_items: list[dict[str, Any]]  # this request's own input items, with ids (GET .../input_items)
    logprobs: bool
    # the tokenizer stage's `messages[k]` (the conversation sent to the template) as this request names it:
    # `input[i]`, or the conversation of previous_response_id (whose messages may hold images too)
    names: dict[int, str] = field(default_factory=dict)

    def renamed(self, exc: BaseException) -> BaseException:
        """A backend error (the tokenizer stage's: a bad image, a prompt past the context) naming the
        Responses field rather than the chat message it was sent as."""
        if not isinstance(exc, (APIError, BackendError)) or not exc.param:
            return exc
        if exc.param == "messages":
            exc.param = "input"
        elif (at := _MESSAGE_AT.match(exc.param)) is not None and int(at[1]) in self.names:
            name = self.names[int(at[1])]
            exc.message = exc.message.replace(at[0], name, 1)
            exc.param = name + exc.param[at.end():] if name.startswith("input[") else "previous_response_id"
        return exc


_MESSAGE_AT = re.compile(r"messages\[(\d+)\]")


def _text_of(parts: str | list[InputPart] | None, where: str, types: tuple[str, ...] = TEXT_PART_TYPES,
             at: int = 0) -> str:
    """The text of content parts (`at`: the index of the first of `parts` in its content)."""
    if parts is None or isinstance(parts, str):
        return parts or ""
    texts = []
    for j, part in enumerate(parts, at):
        if part.type not in types:
            images = " (input_image goes in a message's content)" if part.type == IMAGE_PART else ""
            raise unsupported(f"{where}[{j}]: content type {part.type!r} is not supported here; this server takes "
                              f"{' / '.join(types)} parts{images}.", f"{where}[{j}].type")
        if part.text is None:
            raise invalid(f"{where}[{j}] has no 'text'.", f"{where}[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def _image(part: InputPart, where: str) -> ContentPart:
    """An input_image part as the chat route's image part; the tokenizer stage fetches and decodes it."""
    if part.file_id is not None:
        raise unsupported(f"{where}.file_id: images by file_id are not supported (this server keeps no files); "
                          "send the image as image_url, a data: URL.", f"{where}.file_id")
    if not part.image_url:
        raise invalid(f"{where} has no image_url (a data: URL, or an http(s) URL).", f"{where}.image_url")
    if part.detail is not None and part.detail not in IMAGE_DETAILS:
        raise invalid(f"{where}.detail must be one of {', '.join(IMAGE_DETAILS)}.", f"{where}.detail")
    return ContentPart(type=IMAGE_PART, image_url=ImageURL(url=part.image_url, detail=part.detail))


def _content(parts: str | list[InputPart] | None, where: str) -> str | list[str | ContentPart]:
    """A message's content: its text, or, when it holds images, its parts in order (text and images)."""
    if not isinstance(parts, list) or not any(part.type == IMAGE_PART for part in parts):
        return _text_of(parts, where)
    out: list[str | ContentPart] = []
    for j, part in enumerate(parts):
        out.append(_image(part, f"{where}[{j}]") if part.type == IMAGE_PART else
                   ContentPart(type="text", text=_text_of([part], where, at=j)))
    return out


def _reasoning_text(item: InputItem, at: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's text."""
    if isinstance(item.content, list) and item.content:
        return _text_of(item.content, f"{at}.content", REASONING_PART_TYPES)
    return "".join(str(part.get("text") or "") for part in item.summary or [])


def _last_assistant(messages: list[ChatMessage]) -> ChatMessage:
    """The assistant message a function_call belongs to (a new one unless the last message is an
    assistant's). Its content is "" rather than null: templates that concatenate `content` (SmolLM2's,
    among others) fail on null."""
    if not messages or messages[-1].role != "assistant":
        messages.append(ChatMessage(role="assistant", content=""))
    return messages[-1]


def items_to_messages(items: list[InputItem], where: str = "input",
                      sources: dict[int, int] | None = None) -> list[ChatMessage]:
    """Input items as chat messages: an assistant's reasoning, text and function calls that follow one
    another form one assistant message; a function_call_output is a `tool` message. `sources` gets the
    item index of each message made from one message item."""
    messages: list[ChatMessage] = []
    names: dict[str, str] = {}
    reasoning: str | None = None
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            if item.role not in MESSAGE_ROLES:
                raise invalid(f"{at}.role must be one of {', '.join(MESSAGE_ROLES)}.", f"{at}.role")
            content = _content(item.content, f"{at}.content")
            if sources is not None:
                sources[len(messages)] = i
            messages.append(ChatMessage(role=item.role, content=content))  # type: ignore[arg-type]
            if item.role == "assistant" and reasoning is not None:
                messages[-1].reasoning_content, reasoning = reasoning, None
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise invalid(f"{at}: a function_call needs call_id, name and arguments.", at)
            msg = _last_assistant(messages)
            if reasoning is not None:
                msg.reasoning_content, reasoning = reasoning, None
            msg.tool_calls = [*(msg.tool_calls or []), {"id": item.call_id, "type": "function",
                                                         "function": {"name": item.name, "arguments": item.arguments}}]
            names[item.call_id] = item.name
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise invalid(f"{at}: a function_call_output needs call_id and output.", at)
            msg = ChatMessage(role="tool", content=_text_of(item.output, f"{at}.output"), tool_call_id=item.call_id)
            if item.call_id in names:
                msg.name = names[item.call_id]
            messages.append(msg)
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, at)
        elif kind is None:
            raise invalid(f"{at} needs a type (or a role, for a message).", f"{at}.type")
        else:
            raise unsupported(f"{at}: input item type {kind!r} is not supported; send message, function_call, "
                              "function_call_output or reasoning items.", f"{at}.type")
    return messages


def input_messages(req: ResponsesRequest, sources: dict[int, int] | None = None) -> list[ChatMessage]:
    if isinstance(req.input, str):
        return [ChatMessage(role="user", content=req.input)] if req.input else []
    return items_to_messages(req.input, sources=sources)


def _part_dict(part: InputPart, kind_of_text: str) -> dict[str, Any]:
    """A content part as an input item lists it (GET .../input_items)."""
    if part.type == IMAGE_PART:
        return {"type": IMAGE_PART, "image_url": part.image_url, "file_id": part.file_id,
                "detail": part.detail or "auto"}
    return {"type": part.type or kind_of_text, "text": part.text or "",
            **({"annotations": []} if part.type == "output_text" else {})}


def input_item_dicts(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as stored items, each with an id (a string input is one user message)."""
    if isinstance(req.input, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    else:
        items = []
        for item in req.input:
            kind = item.type or "message"
            out: dict[str, Any] = {"type": kind}
            if kind == "message":
                out["role"] = item.role
                kind_of_text = "output_text" if item.role == "assistant" else "input_text"
                parts = item.content if isinstance(item.content, list) else \
                    [InputPart(type=kind_of_text, text=item.content or "")]
                out["content"] = [_part_dict(p, kind_of_text) for p in parts]
            elif kind == "function_call":
                out.update(call_id=item.call_id, name=item.name, arguments=item.arguments)
            elif kind == "function_call_output":
                out.update(call_id=item.call_id, output=item.output if isinstance(item.output, str) else
                           _text_of(item.output, "output"))
            elif kind == "reasoning":
                out.update(summary=item.summary or [])
            items.append(out)
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    for out in items:
        out.setdefault("id", new_id(prefix.get(out["type"], "item")))
        out["status"] = "completed"
    if not isinstance(req.input, str):
        for out, item in zip(items, req.input):
            if item.id:
                out["id"] = item.id
    return items


# --------------------------------------------------------------------------- fields

def _check_fields(req: ResponsesRequest) -> None:
    for name in ResponsesNotSupported.__struct_fields__:
        if getattr(req, name) is not None:
            raise unsupported(f"{name} is not supported by this server; leave it out (or null).", name)
    if req.truncation == "auto":
        raise unsupported("truncation 'auto' is not supported; a prompt longer than the context is a 400.",
                          "truncation")
    if req.text is not None and req.text.verbosity is not None:
        raise unsupported("text.verbosity is not supported by this server; leave it out (or null).",
                          "text.verbosity")
    if req.background and not req.store:
        raise invalid("background responses need store (leave store true).", "background")
    if req.background and req.stream:
        raise unsupported("a streamed background response is not supported; stream, or poll a background one.",
                          "stream")
    for i, name in enumerate(req.include or []):
        if name not in INCLUDE_ACCEPTED:
            raise unsupported(f"include {name!r} is not supported; this server includes {INCLUDE_LOGPROBS}.",
                              f"include[{i}]")
    meta = req.metadata or {}
    if len(meta) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise invalid("metadata holds at most 16 pairs, keys of at most 64 and values of at most 512 characters.",
                      "metadata")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; any other tool (web_search, file_search, mcp, ...) is a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(f"tools[{i}]: tool type {kind!r} is not supported; only function tools are (this "
                              "server runs no built-in tools).", f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(f"tool_choice type {choice.get('type')!r} is not supported; use none, auto, required or "
                      "{\"type\": \"function\", \"name\": ...}.", "tool_choice")


def _response_format(text: Any) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        if "schema" not in fmt:
            raise invalid("text.format json_schema needs schema (and a name).", "text.format.schema")
        return ResponseFormat(type="json_schema", json_schema={k: fmt[k] for k in ("name", "schema", "strict")
                                                               if k in fmt})
    if kind in ("text", "json_object"):
        return ResponseFormat(type=kind)
    raise unsupported(f"text.format type {kind!r} is not supported; use text, json_object or json_schema.",
                      "text.format.type")


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return None
    if effort == "none":
        return {"enable_thinking": False}
    return {"reasoning_effort": effort}


_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "chat_template_kwargs": "reasoning", "messages": "input"}


def _renamed(exc: APIError) -> APIError:
    """The chat checks' error, naming the Responses field."""
    if exc.param:
        head, sep, rest = exc.param.partition(".")
        base = head.split("[")[0]
        if base in _PARAMS:
            new = _PARAMS[base] + head[len(base):] + sep + rest
            exc.message = exc.message.replace(exc.param, new).replace(base, _PARAMS[base])
            exc.param = new
        elif base == "tools":
            exc.param = exc.param.replace(".function", "")
            exc.message = exc.message.replace(".function.", ".")
    return exc


def responses_plan(req: ResponsesRequest, limits: Limits, history: list[ChatMessage] | None = None) -> ResponsesPlan:
    """Check a Responses request and build its Plan; `history` is the conversation of
    previous_response_id (its input and output messages), which comes before this input."""
    _check_fields(req)
    sources: dict[int, int] = {}
    history = history or []
    messages = [*history, *input_messages(req, sources)]
    if not messages:
        raise invalid("input must not be empty.", "input")
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    names = {len(system) + h: f"the conversation of previous_response_id's messages[{h}]"
             for h in range(len(history))}
    names.update({len(system) + len(history) + m: f"input[{i}]" for m, i in sources.items()})
    logprobs = INCLUDE_LOGPROBS in (req.include or [])
    chat = ChatCompletionRequest(
        messages=[*system, *messages], model=req.model, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, stop=req.stop, ignore_eos=req.ignore_eos, priority=req.priority,
        user=req.user or req.safety_identifier, response_format=_response_format(req.text),
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, logprobs=logprobs or None,
        top_logprobs=req.top_logprobs if logprobs else None, chat_template_kwargs=_template_kwargs(req))
    try:
        plan = chat_plan(chat, limits)
    except APIError as exc:
        raise _renamed(exc) from None
    rid = new_id("resp")
    plan.id = rid
    for submit in plan.submits:
        submit.rid = rid
        submit.spec.metadata["request_id"] = rid
    return ResponsesPlan(plan, req, messages, input_item_dicts(req), logprobs, names)
