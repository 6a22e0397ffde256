"""/v1/responses: create a whole response (streaming and stored responses come in later steps).

A request is planned by responses_input.responses_plan (the chat route's Plan) and served through
the generation routes' Gate and `merged` outputs, so limits, timeouts and disconnects behave as on
/v1/chat/completions.
"""

from __future__ import annotations

from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api.backend import Backend
from parallm.api.generation import GenerationRoutes
from parallm.api.http import REQUEST_ID, ClientGone, DisconnectWatch, json_response, read_body
from parallm.api.merge import Deadlines, merged
from parallm.api.outputs import Collector
from parallm.api.responses_input import responses_plan
from parallm.api.responses_output import ReasoningTokens, finished_response
from parallm.api.responses_schemas import ResponsesRequest
from parallm.api.validate import decode, unsupported
from parallm.config import ServerConfig


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
        for name in ("stream", "background", "previous_response_id"):
            if getattr(req, name) not in (None, False):
                raise unsupported(f"{name} is not supported yet.", name)
        rp = await self.gen.plan(body, lambda _, limits: responses_plan(req, limits))
        request.scope[REQUEST_ID] = rp.plan.id
        self.gen.gate.enter()
        watch = DisconnectWatch(request.receive)
        outputs = merged(self.backend, rp.plan.submits, self._deadlines())
        try:
            collector, reasoning = Collector(rp.plan), ReasoningTokens()
            await watch.race(_collect(outputs, collector, reasoning))
            return json_response(finished_response(rp, collector.chat(), reasoning.count))
        except ClientGone:
            return Response(status_code=499)
        finally:
            await outputs.aclose()
            watch.stop()
            self.gen.gate.leave()


def routes(backend: Backend, server: ServerConfig, gen: GenerationRoutes,
           endpoint: Callable[[Any], Any]) -> list[Route]:
    r = ResponsesRoutes(backend, server, gen)
    return [Route("/v1/responses", endpoint(r.create), methods=["POST"])]
