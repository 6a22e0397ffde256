"""The OpenAI-compatible HTTP application: `build_app(backend, server)`.

Every error leaves as OpenAI's `{"error": {message, type, param, code}}`: bad input is 400 (type
errors included, as OpenAI does, never 422), unknown model 404, unknown route 404, wrong method
405, BackendError with its own status, and anything unexpected is logged and answered 500.
"""

from __future__ import annotations

import logging
import time
from functools import wraps
from typing import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api import adapters, responses_routes, vllm_admin
from parallm.api.auth import BearerAuth, api_keys
from parallm.api.backend import Backend, BackendError
from parallm.api.errors import APIError, error_response, model_not_found
from parallm.api.generation import GenerationRoutes
from parallm.api.health import HealthRoutes
from parallm.api.http import json_response, read_body
from parallm.api.metrics import AccessLog, CountRequests, MetricsRoute
from parallm.api.openapi import openapi_document
from parallm.api.policies import PolicyBackend, policy_routes
from parallm.api.pooling import pooling_routes
from parallm.api.rl import rl_routes
from parallm.api.schemas import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                 TokenizeResponse)
from parallm.api.translate import message_dict
from parallm.api.validate import Limits, check_model, check_token_ids, check_tokenize, decode
from parallm.config import ServerConfig
from parallm.config.pooling import no_generator
from parallm.metrics import ServerMetrics
from parallm.protocol import Detokenize, Tokenize, pack_ids

log = logging.getLogger("parallm.api")

Handler = Callable[[Request], Awaitable[Response]]


def endpoint(handler: Handler) -> Handler:
    """Turn APIError, BackendError and unexpected exceptions into OpenAI error responses."""

    @wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as exc:
            return error_response(exc)
        except BackendError as exc:
            return error_response(APIError.from_backend(exc))
        except Exception:  # noqa: BLE001 - the client gets an error body; the traceback goes to the log
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(APIError(500, "The server had an error while processing your request.",
                                           code="internal_error"))

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"Unknown route: {request.method} {request.url.path}", "unknown_url"
    elif exc.status_code == 405:
        message, code = f"Method {request.method} is not allowed on {request.url.path}.", "method_not_allowed"
    else:
        message, code = exc.detail, None
    return error_response(APIError(exc.status_code, message, code=code, headers=exc.headers))


class Routes:
    """The non-generation endpoints."""

    def __init__(self, backend: Backend, server: ServerConfig, generates: bool = True) -> None:
        self.backend = backend
        self.server = server
        self.generates = generates
        self.created = int(time.time())
        self.openapi = openapi_document()

    def cards(self) -> list[ModelCard]:
        """The generator (when one is served), then the pooling models (model.pooling)."""
        name = self.backend.model_name
        generator = [ModelCard(id=name, created=self.created, root=name,
                               max_model_len=int(self.backend.max_model_len or 0) or None)] if self.generates else []
        return generator + [ModelCard(id=info.name, created=self.created, root=info.name, max_model_len=info.max_len)
                            for info in self.backend.pooling_models.values()]

    async def models(self, request: Request) -> Response:
        """The served model and the pooling models, then one card per loaded adapter as vLLM lists LoRA
        adapters: `root` where its latest version was loaded from, `parent` the served model. An engine that
        cannot answer (down, restarting) leaves the adapters out rather than failing the listing."""
        try:
            adapters = (await self.backend.list_adapters()).adapters if self.generates else []
        except BackendError:
            adapters = []
        cards = [ModelCard(id=a.name, created=self.created, owned_by="parallm", parent=self.backend.model_name,
                           root=a.versions[-1].source if a.versions else a.name) for a in adapters]
        return json_response(ModelList(data=[*self.cards(), *cards]))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        card = next((c for c in self.cards() if c.id == name), None)
        if card is None:
            raise model_not_found(name)
        return json_response(card)

    async def tokenize(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), TokenizeRequest)
        check_tokenize(req, _limits_model(self.backend))
        if req.messages is not None:
            message = Tokenize(qid="", reply_to=b"", messages=[message_dict(m) for m in req.messages],
                               add_generation_prompt=req.add_generation_prompt,
                               add_special_tokens=bool(req.add_special_tokens),
                               chat_template_kwargs=dict(req.chat_template_kwargs or {}))
        else:
            message = Tokenize(qid="", reply_to=b"", prompt=req.prompt,
                               add_special_tokens=req.add_special_tokens is not False)
        ids = await self.backend.tokenize(message)
        tokens = [int(t) for t in ids]
        return json_response(TokenizeResponse(count=len(tokens), max_model_len=int(self.backend.max_model_len or 0),
                                              tokens=tokens))

    async def detokenize(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), DetokenizeRequest)
        check_model(req.model, _limits_model(self.backend))
        check_token_ids(req.tokens)
        text = await self.backend.detokenize(Detokenize(qid="", reply_to=b"", ids=pack_ids(req.tokens)))
        return json_response(DetokenizeResponse(prompt=text))

    async def openapi_json(self, request: Request) -> Response:
        return json_response(self.openapi)


def _limits_model(backend: Backend) -> Limits:
    return Limits(model_name=backend.model_name)


# What a server with no generator (model.path a pooling model) serves; every other route answers 400
SERVED_WITHOUT_GENERATOR = frozenset({
    "/v1/embeddings", "/v1/classifications", "/classify", "/v1/rewards", "/pooling", "/v1/models",
    "/v1/models/{model:path}", "/v1/tokenize", "/v1/detokenize", "/tokenize", "/detokenize", "/health", "/livez",
    "/readyz", "/metrics", "/openapi.json", "/pause", "/resume", "/is_paused"})


def _no_generator(backend: Backend, route: Route) -> Route:
    """`route` answering 400 naming why: the server's model is a pooling model, no generator runs."""
    name = backend.model_name
    info = backend.pooling_models.get(name)
    task = info.task if info is not None else "pooling"
    routes = {"embed": "/v1/embeddings", "reward": "/v1/rewards", "classify": "/v1/classifications"}

    async def refuse(request: Request) -> Response:
        raise APIError(400, f"{request.method} {route.path} needs a text generator; {no_generator(name, task)}. It "
                            f"serves {routes.get(task, '/pooling')}, /pooling, /v1/models, /tokenize, /health and "
                            "/metrics.", param="model", code="model_not_generative")

    return Route(route.path, endpoint(refuse), methods=list(route.methods or []))


def build_app(backend: Backend, server: ServerConfig, metrics: ServerMetrics | None = None,
              policies: PolicyBackend | None = None, *, generates: bool = True) -> Starlette:
    """The Starlette app serving `backend` with the auth, body and concurrency limits of `server`.

    `metrics` is where /metrics reads from (the ingress stage shares it with its backend, which
    feeds it engine stats and token timings); without one the app counts HTTP answers only.
    With `policies` (the policy stage), /v1/rl/act, /v1/predict and /v1/policies are served too.
    Without `generates` (model.path is a pooling model), only SERVED_WITHOUT_GENERATOR's routes (and the
    policies') serve; the others answer 400 `model_not_generative`, naming the model and its task.
    """
    metrics = metrics or ServerMetrics()
    gen = GenerationRoutes(backend, server, metrics)
    misc = Routes(backend, server, generates)
    health = HealthRoutes(backend)
    routes = [
        Route("/v1/completions", endpoint(gen.completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(gen.chat), methods=["POST"]),
        Route("/v1/chat/completions/tokens", endpoint(gen.chat_tokens), methods=["POST"]),
        Route("/v1/models", endpoint(misc.models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(misc.model), methods=["GET"]),
        Route("/v1/tokenize", endpoint(misc.tokenize), methods=["POST"]),
        Route("/v1/detokenize", endpoint(misc.detokenize), methods=["POST"]),
        Route("/tokenize", endpoint(misc.tokenize), methods=["POST"]),       # vLLM serves them at the root
        Route("/detokenize", endpoint(misc.detokenize), methods=["POST"]),
        Route("/health", endpoint(health.health), methods=["GET"]),
        Route("/livez", endpoint(health.livez), methods=["GET"]),
        Route("/readyz", endpoint(health.readyz), methods=["GET"]),
        Route("/metrics", endpoint(MetricsRoute(metrics).metrics_text), methods=["GET"]),
        Route("/openapi.json", endpoint(misc.openapi_json), methods=["GET"]),
        *responses_routes.routes(backend, server, gen, endpoint),
        *rl_routes(backend, server, gen.gate, endpoint),
        *pooling_routes(backend, server, gen.gate, endpoint),
        *adapters.routes(backend, server, endpoint),
        *vllm_admin.routes(backend, server, endpoint),
    ]
    if not generates:
        routes = [r if r.path in SERVED_WITHOUT_GENERATOR else _no_generator(backend, r) for r in routes]
    if policies is not None:
        routes += policy_routes(policies, server, lambda: _draining(backend), endpoint, metrics)
    app = _assemble(routes, server, metrics)
    app.state.backend = backend
    app.state.generator = gen
    app.state.metrics = metrics
    return app


def build_policy_app(backend: Backend, policies: PolicyBackend, server: ServerConfig,
                     metrics: ServerMetrics | None = None) -> Starlette:
    """The app of a server with policies and no language model: the policy routes, health and metrics
    (every other route answers 404). `backend` needs only `health()`."""
    metrics = metrics or ServerMetrics()
    health = HealthRoutes(backend)
    routes = [
        *policy_routes(policies, server, lambda: _draining(backend), endpoint, metrics),
        Route("/health", endpoint(health.health), methods=["GET"]),
        Route("/livez", endpoint(health.livez), methods=["GET"]),
        Route("/readyz", endpoint(health.readyz), methods=["GET"]),
        Route("/metrics", endpoint(MetricsRoute(metrics).metrics_text), methods=["GET"]),
    ]
    app = _assemble(routes, server, metrics)
    app.state.backend = backend
    app.state.metrics = metrics
    return app


def _draining(backend: Backend) -> bool:
    try:
        return backend.health().get("status") == "shutting_down"
    except BackendError:
        return False


def _assemble(routes: list[Route], server: ServerConfig, metrics: ServerMetrics) -> Starlette:
    """The app over `routes`: request counting, the access log and Bearer auth as `server` says."""
    keys = api_keys(server)
    middleware = [Middleware(CountRequests, metrics=metrics, routes=routes)]
    if server.access_log:
        middleware.insert(0, Middleware(AccessLog, routes=routes))
    if keys:
        middleware.append(Middleware(BearerAuth, keys=keys, exempt=tuple(server.auth_exempt_paths)))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
