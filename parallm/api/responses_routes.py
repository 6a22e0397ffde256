"""/v1/responses: create a response, whole or streamed (stored responses come in the next step).

A request is planned by responses_input.responses_plan (the chat route's Plan) and served through
the generation routes' Gate and `merged` outputs, so limits, timeouts and disconnects behave as on
/v1/chat/completions.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api.backend import Backend, BackendError
from parallm.api.errors import APIError
from parallm.api.generation import GenerationRoutes, _first, _Stream
from parallm.api.http import REQUEST_ID, ClientGone, DisconnectWatch, json_response, read_body
from parallm.api.merge import Deadlines, merged
from parallm.api.outputs import Collector
from parallm.api.responses_events import ResponseEvents
from parallm.api.responses_input import ResponsesPlan, responses_plan
from parallm.api.responses_output import ReasoningTokens, finished_response
from parallm.api.responses_schemas import ResponsesRequest
from parallm.api.validate import decode, unsupported
from parallm.config import ServerConfig

log = logging.getLogger("parallm.api")


async def _collect(outputs: Any, collector: Collector, reasoning: ReasoningTokens) -> None:
    async for prompt, out in outputs:
        _, piece = collector.add(prompt, out)
        reasoning.add(len(piece.ids), piece.reasoning, piece.text)


class ResponsesRoutes:
    def __init__(self, backend: Backend, server: ServerConfig, gen: GenerationRoutes) -> None:
        self.backend = backend
        self.server = server
        self.gen = gen

    def _deadlines(self) -> Deadlines:
        return Deadlines(self.server.first_token_timeout_s, self.server.request_timeout_s)

    async def create(self, request: Request) -> Response:
        body = await read_body(request, self.server.max_body_bytes)
        req = decode(body, ResponsesRequest)
        for name in ("background", "previous_response_id"):
            if getattr(req, name) not in (None, False):
                raise unsupported(f"{name} is not supported yet.", name)
        rp = await self.gen.plan(body, lambda _, limits: responses_plan(req, limits))
        request.scope[REQUEST_ID] = rp.plan.id
        self.gen.gate.enter()
        handed_off = False
        watch = DisconnectWatch(request.receive)
        outputs = merged(self.backend, rp.plan.submits, self._deadlines())
        try:
            if not req.stream:
                collector, reasoning = Collector(rp.plan), ReasoningTokens()
                await watch.race(_collect(outputs, collector, reasoning))
                return json_response(finished_response(rp, collector.chat(), reasoning.count))
            first = await watch.race(_first(outputs))
            handed_off = True
            return _Stream(self._events(rp, first, outputs), watch, self.gen.gate, outputs)
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_off:
                await outputs.aclose()
                watch.stop()
                self.gen.gate.leave()

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
            for event in writer.failed(exc.code, exc.message, exc.param):
                yield event
        except Exception:  # noqa: BLE001 - the stream has begun: the client gets error events, not a 500
            log.exception("response %s failed mid-stream", rp.plan.id)
            for event in writer.failed("internal_error", "The server had an error while generating this response.",
                                       None):
                yield event
        finally:
            await outputs.aclose()


def routes(backend: Backend, server: ServerConfig, gen: GenerationRoutes,
           endpoint: Callable[[Any], Any]) -> list[Route]:
    r = ResponsesRoutes(backend, server, gen)
    return [Route("/v1/responses", endpoint(r.create), methods=["POST"])]
