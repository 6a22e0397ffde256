"""GET /openapi.json: an OpenAPI 3.1 document of the routes, schemas generated from the msgspec Structs."""

from __future__ import annotations

from typing import Any

import msgspec

from parallm.api import schemas
from parallm.api.errors import ErrorResponse

REF = "#/components/schemas/{name}"

# (method, path, summary, request body type or None, response types: status -> type)
ROUTES: list[tuple[str, str, str, type | None, dict[int, Any]]] = [
    ("post", "/v1/completions", "Text completion (stream: server-sent text_completion chunks)",
     schemas.CompletionRequest, {200: schemas.CompletionResponse}),
    ("post", "/v1/chat/completions", "Chat completion (stream: server-sent chat.completion.chunk objects)",
     schemas.ChatCompletionRequest, {200: schemas.ChatCompletionResponse}),
    ("get", "/v1/models", "The served model", None, {200: schemas.ModelList}),
    ("get", "/v1/models/{model}", "One model", None, {200: schemas.ModelCard}),
    ("post", "/v1/tokenize", "Token ids of a prompt or of chat messages", schemas.TokenizeRequest,
     {200: schemas.TokenizeResponse}),
    ("post", "/v1/detokenize", "Text of token ids", schemas.DetokenizeRequest, {200: schemas.DetokenizeResponse}),
    ("get", "/health", "200 when serving, 503 otherwise", None,
     {200: schemas.HealthResponse, 503: schemas.HealthResponse}),
]

STREAM_TYPES = [schemas.CompletionChunk, schemas.ChatCompletionChunk]


def openapi_document(title: str = "parallm", version: str = "1") -> dict[str, Any]:
    types: list[Any] = [ErrorResponse, *STREAM_TYPES]
    for _, _, _, body, responses in ROUTES:
        types += ([body] if body else []) + list(responses.values())
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    ref = dict(zip(types, refs))
    paths: dict[str, Any] = {}
    for method, path, summary, body, responses in ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {}}
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[body]}}}
        for status, kind in responses.items():
            content: dict[str, Any] = {"application/json": {"schema": ref[kind]}}
            if kind is schemas.CompletionResponse:
                content["text/event-stream"] = {"schema": ref[schemas.CompletionChunk]}
            if kind is schemas.ChatCompletionResponse:
                content["text/event-stream"] = {"schema": ref[schemas.ChatCompletionChunk]}
            op["responses"][str(status)] = {"description": "OK" if status == 200 else "Not serving",
                                            "content": content}
        op["responses"]["default"] = {"description": "An OpenAI-style error",
                                      "content": {"application/json": {"schema": ref[ErrorResponse]}}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
