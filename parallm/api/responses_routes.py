"""/v1/responses: create (whole, streamed or in the background), retrieve, delete, cancel, input items.

A request is planned by responses_input.responses_plan (the chat route's Plan) and served through
the generation routes' Gate and `merged` outputs, so limits, timeouts and disconnects behave as on
/v1/chat/completions. With `store` (the default, as OpenAI's) the finished response and its
conversation go to the ResponseStore, where `previous_response_id` continues from them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api.backend import Backend, BackendError
from parallm.api.errors import APIError, invalid
from parallm.api.generation import GenerationRoutes
from parallm.api.http import REQUEST_ID, json_response, read_body
from parallm.api.merge import Deadlines, merged
from parallm.api.outputs import Collector
from parallm.api.responses_events import ResponseEvents
from parallm.api.responses_input import ResponsesPlan, responses_plan
from parallm.api.responses_output import ReasoningTokens, finished_response, output_messages, response_object
from parallm.api.responses_schemas import (DeletedResponse, InputItemList, ResponseError, ResponseObject,
                                           ResponsesRequest)
from parallm.api.responses_store import ResponseStore, Stored
from parallm.api.schemas import ChatMessage
from parallm.api.validate import decode
from parallm.config import ServerConfig

log = logging.getLogger("parallm.api")


def not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found (never stored, deleted, or evicted from the "
                    "bounded store).", param="response_id", code="response_not_found")


async def _collect(outputs: Any, collector: Collector, reasoning: ReasoningTokens) -> None:
    async for prompt, out in outputs:
        _, piece = collector.add(prompt, out)
        reasoning.add(len(piece.ids), piece.reasoning, piece.text)


def _failed(rp: ResponsesPlan, exc: BaseException) -> ResponseObject:
    message = exc.message if isinstance(exc, (APIError, BackendError)) else "The server had an error."
    return response_object(rp, "failed", error=ResponseError(code="server_error", message=message))


class ResponsesRoutes:
    def __init__(self, backend: Backend, server: ServerConfig, gen: GenerationRoutes) -> None:
        self.backend = backend
        self.server = server
        self.gen = gen
        self.store = ResponseStore(server.responses_store_max, server.responses_store_mb << 20)

    def _deadlines(self) -> Deadlines:
        return Deadlines(self.server.first_token_timeout_s, self.server.request_timeout_s)

    def _history(self, req: ResponsesRequest) -> list[ChatMessage]:
        if req.previous_response_id is None:
            return []
        entry = self.store.get(req.previous_response_id)
        if entry is None:
            exc = not_found(req.previous_response_id)
            exc.param = "previous_response_id"
            raise exc
        if entry.running:
            raise invalid(f"Response '{req.previous_response_id}' has not finished yet.", "previous_response_id")
        return list(entry.messages)

    def _keep(self, rp: ResponsesPlan, response: ResponseObject) -> None:
        if rp.req.store:
            self.store.put(response.id, Stored(response, [*rp.messages, *output_messages(response.output)],
                                               rp.input_items))

    # ------------------------------------------------------------------ POST /v1/responses

    async def create(self, request: Request) -> Response:
        body = await read_body(request, self.server.max_body_bytes)
        req = decode(body, ResponsesRequest)
        history = self._history(req)
        rp = await self.gen.plan(body, lambda _, limits: responses_plan(req, limits, history))
        request.scope[REQUEST_ID] = rp.plan.id
        self.gen.gate.enter()
        if req.background:
            return self._background(rp)

        async def collect(outputs: Any) -> Response:
            collector, reasoning = Collector(rp.plan), ReasoningTokens()
            await _collect(outputs, collector, reasoning)
            response = finished_response(rp, collector.chat(), reasoning.count)
            self._keep(rp, response)
            return json_response(response)

        try:
            return await self.gen.answer(request, rp.plan.submits, collect,
                                         (lambda first, outputs: self._events(rp, first, outputs)) if req.stream
                                         else None)
        except (APIError, BackendError) as exc:  # the tokenizer stage's errors name chat messages
            raise rp.renamed(exc) from None

    async def _events(self, rp: ResponsesPlan, first: Any, outputs: Any) -> AsyncIterator[bytes]:
        writer = ResponseEvents(rp)
        try:
            for event in writer.opening():
                yield event
            if first is not None:
                for event in writer.add(*first):
                    yield event
            async for prompt, out in outputs:
                for event in writer.add(prompt, out):
                    yield event
            for event in writer.closing():
                yield event
        except (APIError, BackendError) as exc:
            rp.renamed(exc)
            for event in writer.failed(exc.code, exc.message, exc.param):
                yield event
        except Exception:  # noqa: BLE001 - the stream has begun: the client gets error events, not a 500
            log.exception("response %s failed mid-stream", rp.plan.id)
            for event in writer.failed("internal_error", "The server had an error while generating this response.",
                                       None):
                yield event
        finally:
            await outputs.aclose()
            if writer.final is not None:
                self._keep(rp, writer.final)

    # ------------------------------------------------------------------ background

    def _background(self, rp: ResponsesPlan) -> Response:
        entry = Stored(response_object(rp, "queued"), list(rp.messages), rp.input_items)
        entry.task = asyncio.get_running_loop().create_task(self._run(rp, entry))
        entry.task.add_done_callback(lambda _: self._never_ran(rp, entry))
        self.store.put(rp.plan.id, entry)
        return json_response(entry.response)

    def _never_ran(self, rp: ResponsesPlan, entry: Stored) -> None:
        """A task cancelled before its first step never enters _run's body (nor its finally): release
        its Gate slot and store it cancelled here."""
        if entry.response.status != "queued":
            return
        self.gen.gate.leave()
        entry.task = None
        if self.store.entries.get(rp.plan.id) is entry:
            self._keep(rp, response_object(rp, "cancelled"))

    async def _run(self, rp: ResponsesPlan, entry: Stored) -> None:
        """Generate a background response to its end (or its cancellation) and store that."""
        collector, reasoning = Collector(rp.plan), ReasoningTokens()
        outputs = merged(self.backend, rp.plan.submits, self._deadlines())
        try:
            entry.response = response_object(rp, "in_progress")
            await _collect(outputs, collector, reasoning)
            response = finished_response(rp, collector.chat(), reasoning.count)
        except asyncio.CancelledError:
            response = finished_response(rp, collector.chat(), reasoning.count)
            response.status, response.incomplete_details = "cancelled", None
        except Exception as exc:  # noqa: BLE001 - a background failure is the stored response's error
            if not isinstance(exc, (APIError, BackendError)):
                log.exception("background response %s failed", rp.plan.id)
            response = _failed(rp, rp.renamed(exc))
        finally:
            await outputs.aclose()
            self.gen.gate.leave()
        entry.task = None
        if self.store.entries.get(rp.plan.id) is entry:  # not deleted meanwhile
            self._keep(rp, response)

    # ------------------------------------------------------------------ by id

    def _entry(self, request: Request) -> Stored:
        rid = request.path_params["response_id"]
        entry = self.store.get(rid)
        if entry is None:
            raise not_found(rid)
        return entry

    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise invalid("Streaming a stored response again (GET with stream=true) is not supported.", "stream",
                          code="unsupported_parameter")
        return json_response(self._entry(request).response)

    async def delete(self, request: Request) -> Response:
        entry = self._entry(request)
        self.store.remove(entry.response.id)
        if entry.task is not None:
            entry.task.cancel()
        return json_response(DeletedResponse(id=entry.response.id))

    async def cancel(self, request: Request) -> Response:
        entry = self._entry(request)
        if not entry.response.background:
            raise invalid("Only background responses can be cancelled.", "response_id")
        task = entry.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        return json_response(self._entry(request).response)

    async def input_items(self, request: Request) -> Response:
        entry = self._entry(request)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order must be asc or desc.", "order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise invalid("limit must be an integer from 1 to 100.", "limit")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise invalid(f"No input item with id '{after}'.", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return json_response(InputItemList(data=page, first_id=page[0]["id"] if page else None,
                                           last_id=page[-1]["id"] if page else None, has_more=len(items) > limit))


def routes(backend: Backend, server: ServerConfig, gen: GenerationRoutes,
           endpoint: Callable[[Any], Any]) -> list[Route]:
    r = ResponsesRoutes(backend, server, gen)
    return [
        Route("/v1/responses", endpoint(r.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", endpoint(r.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", endpoint(r.delete), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", endpoint(r.cancel), methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", endpoint(r.input_items), methods=["GET"]),
    ]
