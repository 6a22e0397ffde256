"""Streamed responses: Outputs to OpenAI chunks, framed as server-sent events.

Completions stream `text_completion` objects, chat streams `chat.completion.chunk` objects whose
first chunk per choice carries `delta.role = "assistant"` (sent for every choice before any
content, as vLLM does). With `stream_options.include_usage` every chunk has `"usage": null` and
a last chunk with no choices carries the usage of the whole request. An error after the stream
began is one `data: {"error": ...}` event; the stream always ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from msgspec import UNSET

from parallm.api.backend import BackendError
from parallm.api.errors import APIError, error_event
from parallm.api.http import encode
from parallm.api.outputs import (ChoiceState, Collector, Piece, add_completion_logprobs, chat_logprobs,
                                 prompt_logprobs)
from parallm.api.schemas import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, ChatLogprobs, CompletionChoice,
                                 CompletionChunk, CompletionLogprobs)
from parallm.api.structured import ToolStream
from parallm.api.translate import Plan
from parallm.protocol import Output

log = logging.getLogger("parallm.api")

DONE = b"data: [DONE]\n\n"


def event(chunk: Any) -> bytes:
    return b"data: " + encode(chunk) + b"\n\n"


def _worth_sending(piece: Piece, logprobs: bool, echo_first: bool) -> bool:
    """Skip outputs that add nothing visible (e.g. text held back at a possible stop string)."""
    return bool(piece.text or piece.reasoning or piece.tool_calls or piece.tool_call_deltas
                or piece.finish_reason is not None or (logprobs and piece.ids) or echo_first)


class ChunkBuilder:
    """Chunks for one streamed request; `collector` (keep=False) tracks choices and usage."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.collector = Collector(plan, keep=False)
        self.usage_field: Any = None if plan.include_usage else UNSET
        self.sent_prompt_ids = False
        self.tool_streams: dict[int, ToolStream] = {}

    def opening(self) -> list[Any]:
        """Chunks sent before any output: the assistant role of every chat choice."""
        if self.plan.kind != "chat":
            return []
        return [self._chat_chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.plan.num_choices)]

    def add(self, prompt: int, out: Output) -> list[Any]:
        state, piece = self.collector.add(prompt, out)
        first = not state.started
        echo_first = first and self.plan.kind == "completion" and self.plan.echo
        if not _worth_sending(piece, self.plan.logprobs is not None, echo_first):
            return []
        state.started = True
        if self.plan.kind == "chat":
            return [self._chat(state, piece)]
        return [self._completion(state, piece, first)]

    def closing(self) -> list[Any]:
        """The usage chunk, when asked for."""
        if not self.plan.include_usage:
            return []
        usage = self.collector.usage()
        if self.plan.kind == "chat":
            return [self._chat_chunk([], usage=usage)]
        return [CompletionChunk(id=self.plan.id, created=self.plan.created, model=self.plan.model,
                                system_fingerprint=self.plan.fingerprint, choices=[], usage=usage)]

    # ------------------------------------------------------------------ completions

    def _completion(self, state: ChoiceState, piece: Piece, first: bool) -> CompletionChunk:
        plan = self.plan
        text = piece.text
        info = self.collector.prompts.get(state.prompt)
        lp = None
        if plan.logprobs is not None:
            lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
            if first and plan.echo and info is not None and info.logprobs is not None:
                state.offset = add_completion_logprobs(lp, info.tokens or [], info.logprobs, info.top or [],
                                                       plan.logprobs, state.offset)
            state.offset = add_completion_logprobs(lp, piece.tokens, piece.logprobs, piece.top, plan.logprobs,
                                                   state.offset)
        if first and plan.echo and info is not None and info.text is not None:
            text = info.text + text
        choice = CompletionChoice(index=state.index, text=text, logprobs=lp, finish_reason=piece.finish_reason,
                                  stop_reason=piece.stop_reason)  # type: ignore[arg-type]
        if plan.return_token_ids:
            choice.token_ids = piece.ids
            if first:
                choice.prompt_token_ids = info.ids or [] if info is not None else []
        if first and plan.prompt_logprobs is not None and info is not None and info.logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs(info, plan.prompt_logprobs)
        return CompletionChunk(id=plan.id, created=plan.created, model=plan.model,
                               system_fingerprint=plan.fingerprint, choices=[choice], usage=self.usage_field)

    # ------------------------------------------------------------------ chat

    def _chat_chunk(self, choices: list[ChatChunkChoice], usage: Any = None) -> ChatCompletionChunk:
        plan = self.plan
        return ChatCompletionChunk(id=plan.id, created=plan.created, model=plan.model,
                                   system_fingerprint=plan.fingerprint, choices=choices,
                                   usage=usage if usage is not None else self.usage_field)

    def _chat(self, state: ChoiceState, piece: Piece) -> ChatCompletionChunk:
        plan = self.plan
        lp = None
        if plan.logprobs is not None and piece.ids:
            lp = ChatLogprobs(content=chat_logprobs(piece.tokens, piece.logprobs, piece.top, plan.logprobs))
        delta, finish = ChatDelta(content=piece.text or None), piece.finish_reason
        if plan.tools is not None and plan.tools.constrained:
            stream = self.tool_streams.get(state.index)
            if stream is None:
                stream = self.tool_streams[state.index] = ToolStream(plan.tools)
            content, calls, finish = stream.feed(piece.text, piece.finish_reason)
            delta = ChatDelta(content=content, tool_calls=calls)
        if piece.tool_call_deltas:  # the model's own syntax (tool_choice auto): fragments, indexed per choice
            delta.tool_calls = piece.tool_call_deltas
        if finish == "stop" and state.tool_calls and not (plan.tools is not None and plan.tools.constrained):
            finish = "tool_calls"
        if piece.reasoning:
            delta.reasoning = delta.reasoning_content = piece.reasoning
        choice = ChatChunkChoice(index=state.index, delta=delta, logprobs=lp,
                                 finish_reason=finish)  # type: ignore[arg-type]
        if piece.finish_reason is not None:
            choice.stop_reason = piece.stop_reason
        if plan.return_token_ids:
            choice.token_ids = piece.ids
        chunk = self._chat_chunk([choice])
        info = self.collector.prompts.get(0)
        if info is not None and not self.sent_prompt_ids:
            if plan.return_token_ids:
                chunk.prompt_token_ids = info.ids or []
            if plan.prompt_logprobs is not None and info.logprobs is not None:
                chunk.prompt_logprobs = prompt_logprobs(info, plan.prompt_logprobs)
            self.sent_prompt_ids = True
        return chunk


async def added(builder: ChunkBuilder, prompt: int, out: Output) -> list[bytes]:
    """The events of one output; one that carries prompt logprobs is turned into events on a worker thread. A
    6k-token prompt's 20 alternatives a position took 0.5 s of Python (PromptInfo.of, prompt_logprobs, then the
    7.5 MB of JSON), during which the ingress's event loop answered no other client; on a thread that work
    yields the GIL to the loop every few milliseconds (issue 30)."""
    if out.prompt_logprobs:
        return await asyncio.to_thread(lambda: [event(c) for c in builder.add(prompt, out)])
    return [event(c) for c in builder.add(prompt, out)]


async def events(plan: Plan, first: tuple[int, Output] | None,
                 outputs: AsyncIterator[tuple[int, Output]]) -> AsyncIterator[bytes]:
    """The SSE events of a streamed request; `first` was read ahead (to answer early errors with a
    real HTTP status). Closing this generator closes `outputs`."""
    builder = ChunkBuilder(plan)
    try:
        for chunk in builder.opening():
            yield event(chunk)
        if first is not None:
            for data in await added(builder, *first):
                yield data
        async for prompt, out in outputs:
            for data in await added(builder, prompt, out):
                yield data
        for chunk in builder.closing():
            yield event(chunk)
    except APIError as exc:
        yield error_event(exc)
    except BackendError as exc:
        yield error_event(APIError.from_backend(exc))
    except Exception:  # noqa: BLE001 - the stream has begun: the client gets an error event, not a 500
        log.exception("request %s failed mid-stream", plan.id)
        yield error_event(APIError(500, "The server had an error while generating this response.",
                                   code="internal_error"))
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
    yield DONE
