"""POST /v1/completions and /v1/chat/completions: body -> Plan -> backend -> OpenAI response.

Non-streamed requests collect every Output while watching for the client to leave. Streamed ones
read the first Output before answering, so an error the backend reports at once (prompt too
long, a stage down) gets its real HTTP status rather than a 200 stream holding an error event.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from parallm.api.backend import Backend
from parallm.api.errors import APIError
from parallm.api.http import REQUEST_ID, ClientGone, DisconnectWatch, EventStream, json_response, read_body
from parallm.api.merge import Deadlines, merged
from parallm.api.outputs import Collector
from parallm.api.schemas import ChatCompletionRequest
from parallm.api.sse import DONE, events
from parallm.api.translate import Plan, chat_plan, completion_plan
from parallm.api.validate import Limits, decode, decode_completion
from parallm.api.vllm_admin import chat_tokens_plan
from parallm.config import ServerConfig
from parallm.metrics import ServerMetrics
from parallm.threads import background_worker

P = TypeVar("P")

# Bodies this large are planned on a worker thread below the event loop's priority. A 62 KiB tool schema under
# tool_choice "required" took 32-43 ms of llguidance's grammar validation on the loop (issue 30): every other
# request on the loop waited, and the ingress process took that core from the engine's step on a 2-core CPU.
# The validation releases the GIL, so the loop keeps serving while it runs; a body under this plans in well
# under a millisecond on the loop.
LARGE_BODY_BYTES = 16_384


class Gate:
    """Counts generation requests in flight; past `limit` (0: none) new ones get 429 with Retry-After."""

    def __init__(self, limit: int, metrics: ServerMetrics | None = None) -> None:
        self.limit = limit
        self.in_flight = 0
        self.metrics = metrics

    def enter(self) -> None:
        if self.limit and self.in_flight >= self.limit:
            if self.metrics is not None:
                self.metrics.rejected.labels("concurrency").inc()
            raise APIError(429, f"Too many requests in flight (the limit is {self.limit}); retry shortly.",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


def backend_limits(backend: Backend, server: ServerConfig) -> Limits:
    """What request validation needs to know about this server."""
    return Limits(model_name=backend.model_name, max_model_len=int(backend.max_model_len or 0),
                  sampling_defaults=backend.sampling_defaults,
                  max_output_tokens=server.max_output_tokens, default_max_tokens=backend.default_max_tokens,
                  max_n=backend.max_n, tool_parser=server.tool_call_parser, max_logprobs=server.max_logprobs,
                  max_constraint_bytes=backend.max_constraint_bytes,
                  max_request_prompt_tokens=server.max_request_prompt_tokens)


class GenerationRoutes:
    """The two generation endpoints over one backend."""

    def __init__(self, backend: Backend, server: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        self.backend = backend
        self.server = server
        self.gate = Gate(server.max_concurrent_requests, metrics)
        self._planner: ThreadPoolExecutor | None = None  # large bodies' plans (LARGE_BODY_BYTES), made lazily
        if metrics is not None:
            metrics.in_flight.set_function(lambda: self.gate.in_flight)

    def limits(self) -> Limits:
        return backend_limits(self.backend, self.server)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, lambda body, limits: completion_plan(decode_completion(body, limits), limits))

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, lambda body, limits: chat_plan(decode(body, ChatCompletionRequest), limits))

    async def chat_tokens(self, request: Request) -> Response:
        """POST /v1/chat/completions/tokens: a chat body with the prompt's ids (vllm_admin.chat_tokens_plan)."""
        return await self._serve(request, chat_tokens_plan)

    async def plan(self, body: bytes, make_plan: Callable[[bytes, Limits], P]) -> P:
        """The request's Plan; a `model` that is not the served one may name a loaded adapter (vLLM's
        LoRA convention), so the adapters are listed before it is refused."""
        try:
            return await self._make(make_plan, body, self.limits())
        except APIError as exc:
            if exc.code != "model_not_found":
                raise
        names = frozenset(a.name for a in (await self.backend.list_adapters()).adapters)
        return await self._make(make_plan, body, replace(self.limits(), adapters=names))

    async def _make(self, make_plan: Callable[[bytes, Limits], P], body: bytes, limits: Limits) -> P:
        """make_plan(body, limits): on the loop for a small body, on the planner thread for a large one."""
        if len(body) < LARGE_BODY_BYTES:
            return make_plan(body, limits)
        if self._planner is None:
            self._planner = ThreadPoolExecutor(2, thread_name_prefix="parallm-plan", initializer=background_worker)
        return await asyncio.get_running_loop().run_in_executor(self._planner, make_plan, body, limits)

    async def _serve(self, request: Request, make_plan: Callable[[bytes, Limits], Plan]) -> Response:
        plan = await self.plan(await read_body(request, self.server.max_body_bytes), make_plan)
        request.scope[REQUEST_ID] = plan.id
        self.gate.enter()

        async def collect(outputs: Any) -> Response:
            collector = Collector(plan)
            await _collect(outputs, collector)

            def respond() -> Response:
                return json_response(collector.chat() if plan.kind == "chat" else collector.completion())

            return await asyncio.to_thread(respond) if plan.prompt_logprobs is not None else respond()

        return await self.answer(request, plan.submits, collect,
                                 (lambda first, outputs: events(plan, first, outputs)) if plan.stream else None)

    async def answer(self, request: Request, submits: Any, collect: Callable[[Any], Awaitable[Response]],
                     stream: Callable[[Any, Any], AsyncIterator[bytes]] | None) -> Response:
        """One generation request's life once it holds a Gate slot: its outputs merged from `submits`
        under the server's deadlines, raced against the client leaving (499), then either `collect`ed
        into one response or, with `stream`, handed to an event stream that owns the outputs and the
        slot from its first output on. Whatever is not handed off is closed and released here."""
        handed_off = False
        watch = DisconnectWatch(request.receive)
        outputs = merged(self.backend, submits, Deadlines(self.server.first_token_timeout_s,
                                                          self.server.request_timeout_s))
        try:
            if stream is None:
                return await watch.race(collect(outputs))
            first = await watch.race(_first(outputs))
            handed_off = True
            return _Stream(stream(first, outputs), watch, self.gate, outputs)
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_off:
                await outputs.aclose()
                watch.stop()
                self.gate.leave()


class _Stream(EventStream):
    """An EventStream that closes the outputs and releases its Gate slot when it ends (the events
    generator may never have started if the client left at once, so it cannot do this itself).

    The slot is released before the final `[DONE]` is sent: a closed-loop client that sends its next
    request as soon as it reads `[DONE]` must not find its finished request still counted (with
    max_concurrent_requests clients that was a 429)."""

    def __init__(self, body: Any, watch: DisconnectWatch, gate: Gate, outputs: Any) -> None:
        self.gate = gate
        self.outputs = outputs
        self.released = False
        super().__init__(self._release_at_done(body), watch)

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.leave()

    async def _release_at_done(self, body: Any) -> Any:
        try:
            async for event in body:
                if event is DONE:
                    self._release()
                yield event
        finally:
            await body.aclose()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.outputs.aclose()
            self._release()


async def _collect(outputs: Any, collector: Collector) -> None:
    async for prompt, out in outputs:
        if out.prompt_logprobs:  # 0.3 s for a 6k prompt x 20 alternatives: off the event loop (sse.added)
            await asyncio.to_thread(collector.add, prompt, out)
        else:
            collector.add(prompt, out)


async def _first(outputs: Any) -> Any:
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        return None
