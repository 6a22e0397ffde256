"""GET /metrics (Prometheus text format) and the middleware that counts every HTTP answer.

The counting middleware sits outside authentication, so 401s are counted too; routes are
labelled by template (unknown paths as "other"), never by the raw path.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from parallm.metrics import CONTENT_TYPE, ServerMetrics, route_label


class CountRequests:
    """ASGI middleware: parallm_http_requests_total{route, method, status} for every response."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

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
            self.metrics.http_requests.labels(route_label(scope["path"]), scope["method"],
                                              str(status or 499)).inc()


class MetricsRoute:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
