"""GET /metrics (Prometheus text format) and the middleware that counts every HTTP answer.

The counting middleware sits outside authentication, so 401s are counted too; routes are
labelled by their template (a path no route matches as "other"), never by the raw path; a stream
the client abandoned counts as 499, not as the 200 its first bytes carried.
"""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from parallm.api.http import CLIENT_GONE
from parallm.metrics import CONTENT_TYPE, ServerMetrics


class CountRequests:
    """ASGI middleware: parallm_http_requests_total{route, method, status} for every response."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: list[BaseRoute] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes or []

    def label(self, scope: Scope) -> str:
        """The template of the route that serves `scope` (`{name:path}` written `{name}`), else "other"."""
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return re.sub(r"\{(\w+):\w+\}", r"{\1}", getattr(route, "path", "other"))
        return "other"

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


class MetricsRoute:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
