"""Liveness, readiness and health: what a load balancer or an orchestrator probes.

- GET /livez: 200 while the ingress process answers at all (no backend call).
- GET /readyz: 200 when every stage is up, the engine serving and the server not draining nor
  overloaded, else 503 (a load balancer sends new work elsewhere).
- GET /health: `{"status": "ok" | "overloaded" | "paused" | "stalled" | "degraded" | "shutting_down", ...}`:
  200 while the server is alive and serving, if busy (ok, overloaded: RL clients such as Atropos stop
  all traffic on anything else; degraded with `"serving": true`: the KV memory is near
  kv.pressure_threshold); 503 when paused, stalled (the engine answers no stats poll), a stage is down
  (degraded), or shutting down.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from parallm.api.backend import Backend, BackendError
from parallm.api.http import json_response

SERVING = ("ok", "overloaded")
READY = ("ok",)


def backend_state(backend: Backend) -> dict:
    try:
        return dict(backend.health())
    except BackendError as exc:
        return {"status": "degraded", "error": exc.message}


class HealthRoutes:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def livez(self, request: Request) -> Response:
        return json_response({"status": "alive"})

    async def readyz(self, request: Request) -> Response:
        state = backend_state(self.backend)
        ready = bool(state.get("ready", state.get("status") in READY))
        body = {"status": "ready" if ready else "not_ready", "health": state.get("status")}
        if state.get("stages_down"):
            body["stages_down"] = state["stages_down"]
        return json_response(body, 200 if ready else 503)

    async def health(self, request: Request) -> Response:
        state = backend_state(self.backend)
        serving = state.get("status") in SERVING or (state.get("status") == "degraded" and state.get("serving"))
        return json_response(state, 200 if serving else 503)
