"""GET /openapi.json: an OpenAPI 3.1 document of every route, schemas generated from the msgspec
Structs the handlers decode. A new route gets an entry here (ROUTES, or `register(...)` where the
route is made); tests/test_openapi_coverage.py names any app route the document lacks, and the slow
fuzz (tests/e2e/test_fuzz.py) posts bodies drawn from each documented schema: no 5xx, no refusal
by the decoder."""

from __future__ import annotations

import re
from typing import Annotated, Any, NamedTuple

import msgspec

from parallm.api import pooling_schemas as pooling
from parallm.api import responses_schemas as responses
from parallm.api import schemas
from parallm.api.errors import ErrorResponse
from parallm.api.openapi_generate import GenerateBodies, exactly_one_prompt

REF = "#/components/schemas/{name}"
ANY = Any  # a body or response that is a JSON value the handler checks itself (documented as such)


class RouteDoc(NamedTuple):
    """One operation of the document. `body`: the request body's type (None: no body; `ANY`: a JSON
    value the handler reads itself; GenerateBodies: /generate's oneOf of formats); `responses`:
    status -> type."""

    method: str
    path: str
    summary: str
    body: Any = None
    responses: dict[int, Any] = {200: ANY}
    body_optional: bool = False


def _route(method: str, path: str, summary: str, body: Any = None, responses: dict[int, Any] | None = None,
           body_optional: bool = False) -> RouteDoc:
    return RouteDoc(method, path, summary, body, responses or {200: ANY}, body_optional)


def _rl():
    from parallm.api import rl_schemas as rl
    from parallm.api.adapters import _Load, _LoadCompat, _Upload
    from parallm.api.vllm_admin import LoadLora, UnloadLora, UpdateFromDisk, UpdateWeights, WeightsRequest

    generate = GenerateBodies()  # a oneOf of the four formats, which exclude each other (openapi_generate.py)
    admin = "vLLM/SGLang/prime-rl admin route (docs/rl.md)"
    nccl = "NCCL weight transfer: 501, naming adapter publishing instead"
    return [
        _route("post", "/generate", "RL generation: vLLM, TRL, MLX RL Inference Server or SGLang shapes", generate),
        _route("post", "/generate/", "as /generate", generate),
        _route("post", "/inference/v1/generate", "vLLM token in/out generation", rl.GenerateTokensRequest),
        _route("get", "/v1/policy", "Adapter versions served (the policy)"),
        _route("post", "/v1/pause", "Pause the engine (keep or abort)", rl.PauseRequest, body_optional=True),
        _route("post", "/v1/resume", "Resume the engine", ANY, body_optional=True),
        _route("post", "/v1/abort", "Abort requests by id, or all", rl.AbortRequest),
        _route("get", "/v1/training/status", "Trainers' latest status"),
        _route("get", "/v1/spec_decode/metrics", "Speculative decoding: acceptance rate, mean accepted tokens, k "
               "distribution"),
        _route("post", "/v1/adapters", "Load an adapter from a directory under adapters.allowed_dirs", _Load),
        _route("get", "/v1/adapters", "Adapters and their versions"),
        _route("post", "/v1/adapters/upload", "Upload an adapter inline (base64 safetensors)", _Upload),
        _route("delete", "/v1/adapters/{name}", "Unload every version of an adapter"),
        _route("post", "/load_adapter", "MLX RL Inference Server: load an adapter directory", _LoadCompat),
        _route("post", "/upload_adapter", "MLX RL Inference Server: multipart adapter upload", ANY),
        _route("post", "/pause", admin, ANY, body_optional=True),
        _route("post", "/resume", admin, ANY, body_optional=True),
        _route("get", "/is_paused", admin),
        _route("get", "/server_info", admin),
        _route("get", "/model_info", admin),
        _route("get", "/get_model_info", admin),
        _route("get", "/health_generate", admin),
        _route("get", "/get_world_size", admin),
        _route("get", "/get_world_size/", admin),
        _route("post", "/v1/load_lora_adapter", "vLLM LoRA API: load", LoadLora),
        _route("post", "/v1/unload_lora_adapter", "vLLM LoRA API: unload", UnloadLora),
        _route("post", "/load_lora_adapter", "prime-rl: load or reload a LoRA in place", LoadLora),
        _route("post", "/skyrl/v1/load_lora_adapter", "SkyRL: reload a LoRA in place", LoadLora),
        _route("post", "/pause_generation", admin, ANY, body_optional=True),
        _route("post", "/continue_generation", admin, ANY, body_optional=True),
        _route("post", "/abort_requests", admin, ANY, body_optional=True),
        _route("post", "/abort_request", admin, ANY, body_optional=True),
        _route("post", "/reset_prefix_cache", admin, ANY, body_optional=True),
        _route("post", "/reset_prefix_cache/", admin, ANY, body_optional=True),
        _route("get", "/flush_cache", admin),
        _route("post", "/flush_cache", admin, ANY, body_optional=True),
        _route("post", "/update_weights", "prime-rl: full weights from a directory (501 for vLLM's NCCL update_info)",
               UpdateWeights, {200: ANY, 501: ANY}),
        _route("post", "/update_weights_from_disk", "SGLang: full weights from a directory", UpdateFromDisk),
        _route("post", "/v1/weights", "Full-weight update from a directory", WeightsRequest),
        *(_route("post", path, nccl, ANY, {501: ANY}, body_optional=True)
          for path in ("/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
                       "/init_communicator/", "/update_named_param/", "/close_communicator/")),
    ]


class ChatTokensRequest(schemas.ChatCompletionRequest, kw_only=True):
    """/v1/chat/completions/tokens: a chat completion request whose prompt is given as token ids too."""

    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]


ROUTES: list[RouteDoc] = [
    _route("post", "/v1/completions", "Text completion (stream: server-sent text_completion chunks)",
           schemas.CompletionRequest, {200: schemas.CompletionResponse}),
    _route("post", "/v1/chat/completions", "Chat completion (stream: server-sent chat.completion.chunk objects)",
           schemas.ChatCompletionRequest, {200: schemas.ChatCompletionResponse}),
    _route("post", "/v1/chat/completions/tokens", "Chat completion from token ids (prime-rl)", ChatTokensRequest,
           {200: schemas.ChatCompletionResponse}),
    _route("post", "/v1/responses", "OpenAI Responses API (stream: server-sent response.* events; background: "
           "answered at once, poll GET)", responses.ResponsesRequest, {200: responses.ResponseObject}),
    _route("get", "/v1/responses/{response_id}", "A stored response", None, {200: responses.ResponseObject}),
    _route("delete", "/v1/responses/{response_id}", "Delete a stored response (cancels it if running)", None,
           {200: responses.DeletedResponse}),
    _route("post", "/v1/responses/{response_id}/cancel", "Cancel a background response", None,
           {200: responses.ResponseObject}),
    _route("get", "/v1/responses/{response_id}/input_items", "A stored response's input items", None,
           {200: responses.InputItemList}),
    _route("get", "/v1/models", "The served model and its adapters", None, {200: schemas.ModelList}),
    _route("get", "/v1/models/{model}", "One model", None, {200: schemas.ModelCard}),
    _route("post", "/v1/tokenize", "Token ids of a prompt or of chat messages", schemas.TokenizeRequest,
           {200: schemas.TokenizeResponse}),
    _route("post", "/v1/detokenize", "Text of token ids", schemas.DetokenizeRequest, {200: schemas.DetokenizeResponse}),
    _route("post", "/tokenize", "as /v1/tokenize (vLLM serves it at the root)", schemas.TokenizeRequest,
           {200: schemas.TokenizeResponse}),
    _route("post", "/detokenize", "as /v1/detokenize", schemas.DetokenizeRequest, {200: schemas.DetokenizeResponse}),
    _route("get", "/health", "200 while serving (busy or not), 503 when paused, stalled, degraded or draining",
           None, {200: schemas.HealthResponse, 503: schemas.HealthResponse}),
    _route("get", "/livez", "200 while ingress answers"),
    _route("get", "/readyz", "200 when ready for new work, else 503"),
    _route("get", "/metrics", "Prometheus text", None, {200: str}),
    _route("get", "/openapi.json", "This document"),
    _route("post", "/v1/embeddings", "Embeddings from a pooling model (model.pooling)", pooling.EmbeddingRequest,
           {200: pooling.EmbeddingResponse}),
    _route("post", "/v1/classifications", "Class probabilities from a classifier pooling model",
           pooling.ClassificationRequest, {200: pooling.ClassificationResponse}),
    _route("post", "/classify", "as /v1/classifications (vLLM)", pooling.ClassificationRequest,
           {200: pooling.ClassificationResponse}),
    _route("post", "/v1/rewards", "One reward per input (text, token ids or chat messages) from a reward model",
           pooling.RewardRequest, {200: pooling.RewardResponse}),
    _route("post", "/pooling", "vLLM's pooling route: a pooling model's output per input (task reward: [score])",
           pooling.PoolingRequest, {200: pooling.PoolingResponse}),
]
_EXTRA: list[RouteDoc] = []


def register(method: str, path: str, summary: str, body: Any = None, responses: dict[int, Any] | None = None,
             *, body_optional: bool = False) -> None:
    """Document a route added elsewhere (its request body's msgspec type, or ANY, and its responses):
    tests/test_openapi_coverage.py fails for an app route that is in no table."""
    _EXTRA.append(_route(method, path, summary, body, responses, body_optional))


def all_routes() -> list[RouteDoc]:
    return [*ROUTES, *_rl(), *_EXTRA]


STREAM_TYPES = [schemas.CompletionChunk, schemas.ChatCompletionChunk]


def _flat(kind: Any) -> list[Any]:
    if isinstance(kind, GenerateBodies):
        return list(kind.types)
    return [] if kind in (None, ANY, str) else [kind]


def _schema(kind: Any, ref: dict[Any, Any], components: dict[str, Any]) -> dict[str, Any]:
    if isinstance(kind, GenerateBodies):
        return kind.schema(ref, components)
    if kind is ANY:
        return {}
    if kind is str:
        return {"type": "string"}
    return ref[kind]


def _refused_fields_are_null(components: dict[str, Any]) -> None:
    """schemas.NotYetSupported's fields are declared only to be refused by name: documented as null."""
    for component in components.values():
        for name in schemas.NotYetSupported.__struct_fields__:
            if name in component.get("properties", {}):
                component["properties"][name] = {"type": "null", "description": "not supported yet: a 400 "
                                                 "naming it unless absent or null"}


def openapi_document(title: str = "parallm", version: str = "1") -> dict[str, Any]:
    routes = all_routes()
    types: list[Any] = [ErrorResponse, *STREAM_TYPES]
    for route in routes:
        types += [k for kind in (route.body, *route.responses.values()) for k in _flat(kind)]
    types = list(dict.fromkeys(types))
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    ref = dict(zip(types, refs))
    exactly_one_prompt(components)
    _refused_fields_are_null(components)
    paths: dict[str, Any] = {}
    for route in routes:
        op: dict[str, Any] = {"summary": route.summary, "responses": {}}
        if route.body is not None:
            op["requestBody"] = {"required": not route.body_optional,
                                 "content": {"application/json": {"schema": _schema(route.body, ref, components)}}}
        for status, kind in route.responses.items():
            media = "text/plain" if kind is str else "application/json"
            content: dict[str, Any] = {media: {"schema": _schema(kind, ref, components)}}
            if kind is schemas.CompletionResponse:
                content["text/event-stream"] = {"schema": ref[schemas.CompletionChunk]}
            if kind is schemas.ChatCompletionResponse:
                content["text/event-stream"] = {"schema": ref[schemas.ChatCompletionChunk]}
            op["responses"][str(status)] = {"description": "OK" if status == 200 else "Not serving" if status == 503
                                            else "Not implemented", "content": content}
        op["responses"]["default"] = {"description": "An OpenAI-style error",
                                      "content": {"application/json": {"schema": ref[ErrorResponse]}}}
        names = [part[1:-1] for part in route.path.split("/") if part.startswith("{")]
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in names]
        paths.setdefault(route.path, {})[route.method] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def undocumented(app_routes: Any) -> list[str]:
    """'METHOD /path' of every route of an app (Starlette routes) that the document leaves out."""
    paths = openapi_document()["paths"]
    missing = []
    for route in app_routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", getattr(route, "path", ""))
        for method in sorted((getattr(route, "methods", None) or set()) - {"HEAD"}):
            if method.lower() not in paths.get(path, {}):
                missing.append(f"{method} {path}")
    return missing
