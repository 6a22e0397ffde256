"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

`APIError` is what the handlers raise; `error_response()` renders one. The helpers at the end
(`unauthorized`, `payload_too_large`, `rate_limited`, `unavailable`, `timeout`) are for the
auth/limits middleware, so every layer answers in the same shape.
"""

from __future__ import annotations

import re
from typing import Mapping

import msgspec
from starlette.responses import Response

from parallm.api.backend import BackendError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status: invalid_request_error, ..., server_error for 5xx."""
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error for the client; `headers` are added to the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or error_type(status)
        self.headers = dict(headers or {})

    @classmethod
    def from_backend(cls, exc: BackendError) -> "APIError":
        headers = {"Retry-After": "1"} if exc.retryable else None
        return cls(exc.status, exc.message, param=exc.param, code=exc.code, headers=headers)

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<path>[^`]*)`(?: in `(?P<outer>[^`]*)`)?)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `([^`]+)`$")


def _param(path: str | None) -> str | None:
    if not path or not path.startswith("$"):
        return None
    return path[2:].replace("[...]", "") or None


def from_validation(exc: msgspec.ValidationError) -> APIError:
    """A msgspec ValidationError as a 400 naming the field, e.g. "Expected `int` >= 1 - at `$.n`"
    becomes "Invalid value for 'n': expected `int` >= 1" with param "n"."""
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches every string
    what, path, outer = m.group("what"), m.group("path"), m.group("outer")
    missing = _MISSING.match(what)
    if missing:
        parent = _param(path)
        param = f"{parent}.{missing.group(1)}" if parent else missing.group(1)
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    param = _param(outer if outer else path)
    detail = what[:1].lower() + what[1:] + (" (in a key)" if outer and path == "key" else "")
    message = f"Invalid value for '{param}': {detail}" if param else f"Invalid request body: {detail}"
    return APIError(400, message, param=param, code="invalid_value")


def from_decode(exc: msgspec.DecodeError) -> APIError:
    return APIError(400, f"We could not parse the JSON body of your request: {exc}. "
                    "The API expects a JSON object.", code="invalid_json")


_encoder = msgspec.json.Encoder()


def error_response(exc: APIError) -> Response:
    headers = dict(exc.headers)
    return Response(_encoder.encode(exc.body()), status_code=exc.status, headers=headers,
                    media_type="application/json")


def error_event(exc: APIError) -> bytes:
    """The SSE event for an error in the middle of a stream (followed by `data: [DONE]`)."""
    return b"data: " + _encoder.encode(exc.body()) + b"\n\n"


# --------------------------------------------------------------------------- for middleware

def unauthorized(message: str = "Incorrect API key provided.") -> Response:
    return error_response(APIError(401, message, code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"}))


def payload_too_large(limit: int) -> Response:
    return error_response(APIError(413, f"The request body is larger than the {limit} bytes this server "
                                   "accepts.", code="request_too_large"))


def rate_limited(message: str = "Too many requests in flight; retry shortly.", retry_after: float = 1) -> Response:
    return error_response(APIError(429, message, code="rate_limit_exceeded",
                                   headers={"Retry-After": str(max(1, round(retry_after)))}))


def unavailable(message: str = "The server is not ready; retry shortly.", code: str = "service_unavailable",
                retry_after: float = 1) -> Response:
    return error_response(APIError(503, message, code=code,
                                   headers={"Retry-After": str(max(1, round(retry_after)))}))


def timeout(message: str = "The request took too long.") -> Response:
    return error_response(APIError(504, message, code="timeout"))
