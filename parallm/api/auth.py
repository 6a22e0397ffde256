"""Bearer-key authentication: every path needs a key except `server.auth_exempt_paths`
(by default /livez, /readyz, /health, /metrics and /openapi.json).

Keys come from `server.api_keys` (the --api-key flag, repeatable, or PARALLM_SERVER__API_KEYS as a
comma-separated list) and `server.api_key_file` (one per line). Every accepted key is compared
with `hmac.compare_digest`, all of them every time, so the answer takes as long for a near miss
as for a wild guess.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from parallm.api.errors import unauthorized
from parallm.config import ServerConfig


def api_keys(server: ServerConfig) -> list[str]:
    """`server.api_keys` plus one key per non-empty line of `server.api_key_file`."""
    keys = [k.strip() for k in server.api_keys if k.strip()]
    if server.api_key_file:
        keys += [line.strip() for line in Path(server.api_key_file).read_text().splitlines() if line.strip()]
    return keys


def _bearer_token(scope: Scope) -> bytes | None:
    """The token of `Authorization: Bearer <token>`, b"" for another scheme, None without the header."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


class BearerAuth:
    """ASGI middleware: a 401 OpenAI error unless `Authorization: Bearer <key>` names an accepted key."""

    def __init__(self, app: ASGIApp, keys: list[str], exempt: tuple[str, ...] | list[str] = ()) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.exempt = frozenset(exempt)

    def accepted(self, token: bytes | None) -> bool:
        if not token:
            return False
        ok = False
        for key in self.keys:  # no early exit: the time taken does not say which key came close
            ok |= hmac.compare_digest(token, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        if not self.accepted(token):
            message = "Incorrect API key provided." if token is not None \
                else "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
            await unauthorized(message)(scope, receive, send)
            return
        await self.app(scope, receive, send)
