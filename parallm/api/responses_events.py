"""A streamed Responses request: the chat route's chunks as the Responses API's typed events.

The chat ChunkBuilder (sse.py) turns Outputs into deltas of content, reasoning and tool calls (with
its tool_choice handling); this turns those into `response.*` events as the openai SDK's stream
state expects them: `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, `response.content_part.added` (message and reasoning),
`response.output_text.delta` / `response.reasoning_text.delta` /
`response.function_call_arguments.delta`, their `.done` events, `response.output_item.done`, and
last `response.completed` (or `response.incomplete`, or `error` then `response.failed`). Each event
is `event: <type>` and `data: <json>` with a `sequence_number` counted from 0; no `[DONE]` follows
(OpenAI sends none).
"""

from __future__ import annotations

from typing import Any

from parallm.api.http import encode
from parallm.api.responses_input import ResponsesPlan, new_id
from parallm.api.responses_output import (ReasoningTokens, function_call_item, response_logprobs, response_object,
                                          response_usage, status_of)
from parallm.api.responses_schemas import (FunctionCall, OutputItem, OutputMessage, OutputText, ReasoningItem,
                                           ReasoningText, ResponseError, ResponseObject, TokenLogprob)
from parallm.api.schemas import ChatCompletionChunk
from parallm.api.sse import ChunkBuilder
from parallm.protocol import Output


class ResponseEvents:
    """The events of one streamed response; `final` is its last response object once it has one."""

    def __init__(self, rp: ResponsesPlan) -> None:
        self.rp = rp
        self.builder = ChunkBuilder(rp.plan)
        self.reasoning_tokens = ReasoningTokens()
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.calls: dict[int, FunctionCall] = {}   # the chat delta's tool-call index -> its item
        self.logprobs: list[TokenLogprob] = []     # not yet sent with a text delta
        self.finish: str | None = None
        self.final: ResponseObject | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = encode({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def opening(self) -> list[bytes]:
        response = response_object(self.rp, "in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def add(self, prompt: int, out: Output) -> list[bytes]:
        state = self.builder.collector.choice(prompt, out.index)
        before = state.num_tokens
        chunks: list[ChatCompletionChunk] = self.builder.add(prompt, out)
        events: list[bytes] = []
        for chunk in chunks:
            for choice in chunk.choices:
                delta = choice.delta
                self.reasoning_tokens.add(state.num_tokens - before, delta.reasoning or "", delta.content or "")
                if choice.logprobs is not None:
                    self.logprobs += response_logprobs(choice.logprobs.content)
                if delta.reasoning:
                    events += self._reasoning(delta.reasoning)
                if delta.content:
                    events += self._text(delta.content)
                for call in delta.tool_calls or []:
                    events += self._call(call)
                if choice.finish_reason is not None:
                    self.finish = choice.finish_reason
        return events

    # ------------------------------------------------------------------ items

    def _index(self, item: OutputItem) -> int:
        return self.items.index(item)

    def _start(self, item: OutputItem) -> list[bytes]:
        events = self._close()
        self.items.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", output_index=self._index(item), item=item))
        if isinstance(item, OutputMessage):
            events.append(self._part("response.content_part.added", item, OutputText(text="")))
        elif isinstance(item, ReasoningItem):
            events.append(self._part("response.content_part.added", item, ReasoningText(text="")))
        return events

    def _part(self, kind: str, item: OutputItem, part: Any) -> bytes:
        return self._event(kind, item_id=item.id, output_index=self._index(item), content_index=0, part=part)

    def _reasoning(self, text: str) -> list[bytes]:
        events = [] if isinstance(self.open, ReasoningItem) else \
            self._start(ReasoningItem(id=new_id("rs"), content=[], status="in_progress"))
        item = self.open
        assert isinstance(item, ReasoningItem)
        item.content[0:1] = [ReasoningText(text=(item.content[0].text if item.content else "") + text)]
        events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=self._index(item),
                                  content_index=0, delta=text))
        return events

    def _text(self, text: str) -> list[bytes]:
        events = [] if isinstance(self.open, OutputMessage) else \
            self._start(OutputMessage(id=new_id("msg"), status="in_progress", content=[]))
        item = self.open
        assert isinstance(item, OutputMessage)
        if not item.content:
            item.content.append(OutputText(text=""))
        item.content[0].text += text
        item.content[0].logprobs += self.logprobs
        events.append(self._event("response.output_text.delta", item_id=item.id, output_index=self._index(item),
                                  content_index=0, delta=text, logprobs=self.logprobs))
        self.logprobs = []
        return events

    def _call(self, delta: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        index = int(delta.get("index", 0))
        args = (delta.get("function") or {}).get("arguments") or ""
        if delta.get("id") or index not in self.calls:
            item = function_call_item({**delta, "function": {**(delta.get("function") or {}), "arguments": ""}},
                                      status="in_progress")
            self.calls[index] = item
            events += self._start(item)
        item = self.calls[index]
        if args:
            item.arguments += args
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=self._index(item), delta=args))
        return events

    def _close(self) -> list[bytes]:
        """The .done events of the open item."""
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = "incomplete" if self.finish == "length" else "completed"
        at = self._index(item)
        events = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.logprobs += self.logprobs
            self.logprobs = []
            events += [self._event("response.output_text.done", item_id=item.id, output_index=at, content_index=0,
                                   text=part.text, logprobs=part.logprobs),
                       self._part("response.content_part.done", item, part)]
        elif isinstance(item, ReasoningItem):
            text = item.content[0].text if item.content else ""
            events += [self._event("response.reasoning_text.done", item_id=item.id, output_index=at, content_index=0,
                                   text=text),
                       self._part("response.content_part.done", item, ReasoningText(text=text))]
        elif isinstance(item, FunctionCall):
            events.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=at,
                                      arguments=item.arguments, name=item.name))
        events.append(self._event("response.output_item.done", output_index=at, item=item))
        return events

    # ------------------------------------------------------------------ the end

    def closing(self) -> list[bytes]:
        """Close the last item and send the whole response (an answer with neither text nor calls is
        one empty message, as the non-streamed response has)."""
        events = []
        if not any(isinstance(i, (OutputMessage, FunctionCall)) for i in self.items):
            events += self._start(OutputMessage(id=new_id("msg"), status="in_progress", content=[]))
            assert isinstance(self.open, OutputMessage)
            self.open.content.append(OutputText(text=""))
        events += self._close()
        usage = response_usage(self.builder.collector.usage(), self.reasoning_tokens.count)
        status = status_of(self.finish)
        self.final = response_object(self.rp, status, self.items, usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.final)]

    def failed(self, code: str | None, message: str, param: str | None) -> list[bytes]:
        """`error`, then `response.failed` with what was generated so far."""
        events = self._close()
        self.final = response_object(self.rp, "failed", self.items,
                                     error=ResponseError(code="server_error", message=message))
        return [*events, self._event("error", code=code, message=message, param=param),
                self._event("response.failed", response=self.final)]
