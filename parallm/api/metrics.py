"""GET /metrics (Prometheus text format) and the middleware that counts every HTTP answer.

The counting middleware sits outside authentication, so 401s are counted too; routes are
labelled by their template (a path no route matches as "other"), never by the raw path; a stream
the client abandoned counts as 499, not as the 200 its first bytes carried.
"""

from __future__ import annotations

import logging
import re
import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from parallm.api.http import CLIENT_GONE, REQUEST_ID
from parallm.logs import request_extra
from parallm.metrics import CONTENT_TYPE, ServerMetrics

access = logging.getLogger("parallm.access")


class RouteLabels:
    """The template of the route that serves a request (`{name:path}` written `{name}`), else "other"."""

    def __init__(self, routes: list[BaseRoute] | None = None) -> None:
        self.routes = routes or []

    def __call__(self, scope: Scope) -> str:
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return re.sub(r"\{(\w+):\w+\}", r"{\1}", getattr(route, "path", "other"))
        return "other"


class CountRequests:
    """ASGI middleware: parallm_http_requests_total{route, method, status} for every response."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: list[BaseRoute] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.label = RouteLabels(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            if scope.get(CLIENT_GONE):
                status = 499
            self.metrics.http_requests.labels(self.label(scope), scope["method"], str(status or 499)).inc()


class AccessLog:
    """ASGI middleware: one log line per HTTP request (logger `parallm.access`) with its method, route,
    status (499 for a client that left), duration and request id: the id a generation route gave
    it (`cmpl-...`, `chatcmpl-...`, `gen-...`, the one its engine request carries), else the
    client's X-Request-Id header."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute] | None = None) -> None:
        self.app = app
        self.label = RouteLabels(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        t0 = time.perf_counter()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if scope.get(CLIENT_GONE) or not status:
                status = 499
            rid = scope.get(REQUEST_ID) or _header(scope, b"x-request-id") or "-"
            ms = 1000 * (time.perf_counter() - t0)
            access.info("%s %s %d %.1fms", scope["method"], scope["path"], status, ms,
                        extra=request_extra(rid, method=scope["method"], route=self.label(scope),
                                            status=status, duration_ms=round(ms, 2)))


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")[:128]
    return ""


class MetricsRoute:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
