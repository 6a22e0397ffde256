"""Bearer-key authentication for /v1/* (health and the OpenAPI document stay open)."""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from parallm.api.errors import unauthorized
from parallm.config import ServerConfig

PROTECTED_PREFIX = "/v1/"


def api_keys(server: ServerConfig) -> list[str]:
    """`server.api_keys` plus one key per non-empty line of `server.api_key_file`."""
    keys = [k for k in server.api_keys if k]
    if server.api_key_file:
        keys += [line.strip() for line in Path(server.api_key_file).read_text().splitlines() if line.strip()]
    return keys


class BearerAuth:
    """ASGI middleware: a 401 OpenAI error unless `Authorization: Bearer <key>` names an accepted key."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    def _accepted(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                token = token.strip()
                return any(hmac.compare_digest(token, key) for key in self.keys)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX) and not self._accepted(scope):
            message = "Incorrect API key provided." if any(n == b"authorization" for n, _ in scope["headers"]) \
                else "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
            await unauthorized(message)(scope, receive, send)
            return
        await self.app(scope, receive, send)
