"""Adapter endpoints: load, upload, list and unload LoRA adapters; choosing one per request.

Routes (registered by `routes(backend, server)` in build_app):
- POST   /v1/adapters          {name, path, version?, format?, config?}: load from a path on the server
- POST   /v1/adapters/upload   multipart/form-data: the safetensors file in `adapter_weights` (or
                               `weights` / `file`), adapter_config.json in `adapter_config` (or
                               `config`, a file or a text field), text fields name?, version?,
                               format?; or JSON {name, weights: base64 safetensors, config: {...}, ...}
- GET    /v1/adapters          names, versions, sizes, and the policy {name: latest version}
- DELETE /v1/adapters/{name}   forget every version of `name`
- POST   /load_adapter         MLX RL Inference Server compatible: {adapter_path, name?} ->
                               {status, policy_version, message}
- POST   /upload_adapter       as /v1/adapters/upload (the MLX RL Inference Server sends multipart
                               adapter_weights + adapter_config), answered like /load_adapter
The engine does the work, on the same typed messages a trainer sends (AdapterPublish, AdapterUnload,
ListAdapters); errors keep the engine's status: 400 bad adapter, 404 unknown adapter or path, 409
version conflict. The two MLX RL Inference Server routes also make the adapter they load the
default policy: requests that name no adapter run under its latest version from then on, as that
server's /generate does (docs/rl.md).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import msgspec
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api.backend import Backend
from parallm.api.errors import APIError, invalid
from parallm.api.http import json_response, read_body
from parallm.api.schemas import Count
from parallm.config import ServerConfig
from parallm.protocol import AdapterLoaded, AdapterPublish

DEFAULT_NAME = "default"  # the adapter /load_adapter loads when no name is given
WEIGHTS_FIELDS = ("adapter_weights", "weights", "file")
CONFIG_FIELDS = ("adapter_config", "config")
TEXT_FIELDS = ("name", "version", "format")
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")  # the latter can carry no file: a clear 400


def split_model(model: str | None, base: str) -> tuple[str | None, str]:
    """`model` as (model, adapter): "<base>:<adapter>" names an adapter of the served model."""
    if model and model.startswith(base + ":") and len(model) > len(base) + 1:
        return base, model[len(base) + 1:]
    return model, ""


def adapter_of(model: str | None, adapter: str, base: str) -> str:
    """The adapter a completion/chat request asks for, from `model: "<base>:<adapter>"` or `model:
    "<adapter>"` (vLLM's LoRA naming; validation has checked it is loaded) and/or its `adapter` field
    (they must agree when both are given)."""
    _, from_model = split_model(model, base)
    if model and model != base and not from_model:
        from_model = model
    if from_model and adapter and from_model != adapter:
        raise invalid(f"model names adapter {from_model!r} but the adapter field says {adapter!r}", "adapter")
    return adapter or from_model


class _Load(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    path: str
    version: Count = 0   # 0: the latest + 1
    format: str = "auto"
    config: dict[str, Any] = {}


class _Upload(msgspec.Struct, forbid_unknown_fields=True):
    weights: str
    name: str = DEFAULT_NAME
    config: dict[str, Any] = {}
    version: Count = 0
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

    async def _load(self, args: dict[str, Any], *, make_default: bool = False) -> AdapterLoaded:
        return await self.backend.load_adapter(AdapterPublish(qid="", reply_to=b"", make_default=make_default, **args))

    async def load(self, request: Request) -> Response:
        req = _decode(await read_body(request, self.limit), _Load)
        loaded = await self._load({"name": req.name, "path": req.path, "version": req.version,
                                   "format": _format(req.format), "config": req.config})
        return json_response(_loaded(loaded))

    async def _upload(self, request: Request, *, make_default: bool = False) -> AdapterLoaded:
        if request.headers.get("content-type", "").lower().startswith(FORM_TYPES):
            return await self._load(await self._multipart(request), make_default=make_default)
        # the weights are base64: allow a third more than the body limit for them
        req = _decode(await read_body(request, self.limit * 4 // 3 + 4096), _Upload)
        try:
            weights = base64.b64decode(req.weights, validate=True)
        except (binascii.Error, ValueError):
            raise invalid("weights must be base64-encoded safetensors bytes", "weights") from None
        return await self._load({"name": req.name, "weights": weights, "config": req.config, "version": req.version,
                                 "format": _format(req.format)}, make_default=make_default)

    async def _multipart(self, request: Request) -> dict[str, Any]:
        """The load arguments of a multipart upload (the body read within the limit first)."""
        body = await read_body(request, self.limit)
        replayed = False

        async def receive() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return {"type": "http.disconnect"}
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(request.scope, receive).form(max_files=2, max_fields=8,
                                                              max_part_size=max(self.limit, 1 << 20))
        except HTTPException as exc:
            raise invalid(f"invalid multipart body: {exc.detail}") from None
        except MultiPartException as exc:
            raise invalid(f"invalid multipart body: {exc.message}") from None
        try:
            return await _upload_args(form)
        finally:
            await form.close()

    async def upload(self, request: Request) -> Response:
        return json_response(_loaded(await self._upload(request)))

    async def list(self, request: Request) -> Response:
        info = await self.backend.list_adapters()
        data = [{"id": a.name, "object": "adapter", "latest_version": a.latest, "bytes": a.bytes,
                 "versions": a.versions} for a in info.adapters]
        return json_response({"object": "list", "data": data, "policy": info.policy, "adapter_bytes": info.adapter_bytes,
                              "default_adapter": info.default_adapter})

    async def delete(self, request: Request) -> Response:
        name = request.path_params["name"]
        result = await self.backend.unload_adapter(name)
        return json_response({"id": name, "object": "adapter", "deleted": True,
                              "versions_removed": result.versions_removed})

    async def load_compat(self, request: Request) -> Response:
        req = _decode(await read_body(request, self.limit), _LoadCompat)
        return _compat(await self._load({"name": req.name, "path": req.adapter_path}, make_default=True))

    async def upload_compat(self, request: Request) -> Response:
        return _compat(await self._upload(request, make_default=True))


async def _upload_args(form) -> dict[str, Any]:
    unknown = sorted(set(form.keys()) - {*WEIGHTS_FIELDS, *CONFIG_FIELDS, *TEXT_FIELDS})
    if unknown:
        raise invalid(f"unknown multipart field {unknown[0]!r}; the fields are {', '.join(WEIGHTS_FIELDS)} (the "
                      f"safetensors file), {', '.join(CONFIG_FIELDS)} (adapter_config.json) and "
                      f"{', '.join(TEXT_FIELDS)}", unknown[0])
    for key in form.keys():
        if len(form.getlist(key)) > 1:
            raise invalid(f"multipart field {key!r} is given more than once", key)
    given = [f for f in WEIGHTS_FIELDS if f in form]
    if len(given) != 1:
        raise invalid("a multipart upload needs the adapter's safetensors file in exactly one of the fields "
                      f"{', '.join(WEIGHTS_FIELDS)}" + (f" (got {', '.join(given)})" if given else ""), "adapter_weights")
    weights = form[given[0]]
    if not isinstance(weights, UploadFile):
        raise invalid(f"multipart field {given[0]!r} must be a file (the safetensors bytes)", given[0])
    configs = [f for f in CONFIG_FIELDS if f in form]
    if len(configs) > 1:
        raise invalid("give the adapter config in one of adapter_config or config, not both", "adapter_config")
    config: dict[str, Any] = {}
    if configs:
        raw = form[configs[0]]
        text = await raw.read() if isinstance(raw, UploadFile) else raw
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise invalid(f"multipart field {configs[0]!r} is not JSON: {exc}", configs[0]) from None
        if not isinstance(config, dict):
            raise invalid(f"multipart field {configs[0]!r} must be a JSON object", configs[0])
    text_fields = {}
    for key in TEXT_FIELDS:
        value = form.get(key)
        if isinstance(value, UploadFile):
            raise invalid(f"multipart field {key!r} must be text, not a file", key)
        text_fields[key] = value
    version = text_fields["version"] or "0"
    if not version.isdigit():
        raise invalid(f"version must be a non-negative integer (got {version!r})", "version")
    return {"name": text_fields["name"] or DEFAULT_NAME, "weights": await weights.read(), "config": config,
            "version": int(version), "format": _format(text_fields["format"] or "auto")}


def _loaded(loaded: AdapterLoaded) -> dict[str, Any]:
    return {"status": "success", "policy_version": loaded.version, "name": loaded.name, "version": loaded.version,
            "bytes": loaded.bytes, "load_ms": loaded.load_ms, "merged": loaded.merged, "default": loaded.default,
            "message": f"adapter {loaded.name!r} version {loaded.version} loaded; new requests"
                       f"{'' if loaded.default else ' naming it'} use it from the next step"}


def _compat(loaded: AdapterLoaded) -> Response:
    """The MLX RL Inference Server's answer to /load_adapter and /upload_adapter."""
    body = _loaded(loaded)
    return json_response({"status": body["status"], "policy_version": loaded.version, "message": body["message"]})


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
