"""Adapter endpoints: load, upload, list and unload LoRA adapters; choosing one per request.

Routes (registered by `routes(backend, server)` in build_app):
- POST   /v1/adapters          {name, path, version?, format?, config?}: load from a path on the server
- POST   /v1/adapters/upload   JSON {name, weights: base64 safetensors, config: {...}, version?, format?}
                               (multipart is not accepted: python-multipart is not installed)
- GET    /v1/adapters          names, versions, sizes, and the policy {name: latest version}
- DELETE /v1/adapters/{name}   forget every version of `name`
- POST   /load_adapter         MLX RL Inference Server compatible: {adapter_path, name?} ->
                               {status, policy_version, message}
- POST   /upload_adapter       as /v1/adapters/upload, answered like /load_adapter
The engine does the work (Query what="adapter_load" / "adapter_unload" / "adapters"); errors keep
the engine's status: 400 bad adapter, 404 unknown adapter or path, 409 version conflict.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api.backend import Backend
from parallm.api.errors import APIError, invalid
from parallm.api.http import json_response, read_body
from parallm.config import ServerConfig

DEFAULT_NAME = "default"  # the adapter /load_adapter loads when no name is given


def split_model(model: str | None, base: str) -> tuple[str | None, str]:
    """`model` as (model, adapter): "<base>:<adapter>" names an adapter of the served model."""
    if model and model.startswith(base + ":") and len(model) > len(base) + 1:
        return base, model[len(base) + 1:]
    return model, ""


def adapter_of(model: str | None, adapter: str, base: str) -> str:
    """The adapter a completion/chat request asks for, from `model: "<base>:<adapter>"` and/or its
    `adapter` field (they must agree when both are given)."""
    _, from_model = split_model(model, base)
    if from_model and adapter and from_model != adapter:
        raise invalid(f"model names adapter {from_model!r} but the adapter field says {adapter!r}", "adapter")
    return adapter or from_model


class _Load(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    path: str
    version: int = 0
    format: str = "auto"
    config: dict[str, Any] = {}


class _Upload(msgspec.Struct, forbid_unknown_fields=True):
    weights: str
    name: str = DEFAULT_NAME
    config: dict[str, Any] = {}
    version: int = 0
    format: str = "auto"


class _LoadCompat(msgspec.Struct):
    adapter_path: str
    name: str = DEFAULT_NAME


def _decode(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise invalid(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None


def _format(value: str) -> str:
    if value not in ("auto", "mlx", "peft"):
        raise invalid(f"format must be auto, mlx or peft (got {value!r})", "format")
    return value


class AdapterRoutes:
    def __init__(self, backend: Backend, server: ServerConfig) -> None:
        self.backend = backend
        self.limit = server.max_body_bytes

    async def _load(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self.backend.query("engine", "adapter_load", args)

    async def load(self, request: Request) -> Response:
        req = _decode(await read_body(request, self.limit), _Load)
        result = await self._load({"name": req.name, "path": req.path, "version": req.version,
                                   "format": _format(req.format), "config": req.config})
        return json_response(result)

    async def _upload(self, request: Request) -> dict[str, Any]:
        # the weights are base64: allow a third more than the body limit for them
        req = _decode(await read_body(request, self.limit * 4 // 3 + 4096), _Upload)
        try:
            weights = base64.b64decode(req.weights, validate=True)
        except (binascii.Error, ValueError):
            raise invalid("weights must be base64-encoded safetensors bytes", "weights") from None
        return await self._load({"name": req.name, "weights": weights, "config": req.config, "version": req.version,
                                 "format": _format(req.format)})

    async def upload(self, request: Request) -> Response:
        return json_response(await self._upload(request))

    async def list(self, request: Request) -> Response:
        info = await self.backend.query("engine", "adapters", {})
        data = [{"id": a["name"], "object": "adapter", "latest_version": a["latest"], "bytes": a["bytes"],
                 "versions": a["versions"]} for a in info.get("adapters", [])]
        return json_response({"object": "list", "data": data, "policy": info.get("policy", {}),
                              "adapter_bytes": info.get("adapter_bytes", 0)})

    async def delete(self, request: Request) -> Response:
        name = request.path_params["name"]
        result = await self.backend.query("engine", "adapter_unload", {"name": name})
        return json_response({"id": name, "object": "adapter", "deleted": True,
                              "versions_removed": result.get("versions_removed", 0)})

    async def load_compat(self, request: Request) -> Response:
        req = _decode(await read_body(request, self.limit), _LoadCompat)
        return _compat(await self._load({"name": req.name, "path": req.adapter_path}))

    async def upload_compat(self, request: Request) -> Response:
        return _compat(await self._upload(request))


def _compat(result: dict[str, Any]) -> Response:
    return json_response({"status": result.get("status", "success"), "policy_version": result["policy_version"],
                          "message": result.get("message", "")})


def routes(backend: Backend, server: ServerConfig, wrap) -> list[Route]:
    """The adapter routes, each handler passed through `wrap` (app.endpoint: errors as OpenAI bodies)."""
    r = AdapterRoutes(backend, server)
    return [
        Route("/v1/adapters", wrap(r.load), methods=["POST"]),
        Route("/v1/adapters", wrap(r.list), methods=["GET"]),
        Route("/v1/adapters/upload", wrap(r.upload), methods=["POST"]),
        Route("/v1/adapters/{name:path}", wrap(r.delete), methods=["DELETE"]),
        Route("/load_adapter", wrap(r.load_compat), methods=["POST"]),
        Route("/upload_adapter", wrap(r.upload_compat), methods=["POST"]),
    ]


__all__ = ["APIError", "AdapterRoutes", "adapter_of", "routes", "split_model"]
