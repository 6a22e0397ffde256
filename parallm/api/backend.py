"""What the HTTP layer needs from the rest of the server: one small async interface.

The ingress stage implements it over ZeroMQ (stages/ingress.py); tests implement it with a
scripted object. Nothing in parallm.api imports ZeroMQ or MLX.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, runtime_checkable

from parallm.protocol import Output, TextSubmit


class BackendError(Exception):
    """A request failed behind the HTTP layer; becomes an OpenAI error response.

    `status` is the HTTP status (400: the request is at fault, e.g. the prompt is too long;
    503: a stage is down), `code` the OpenAI error code, `param` the offending request field,
    `retryable` whether the same request may succeed later (adds `Retry-After`).
    """

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.param, self.retryable = param, retryable


@runtime_checkable
class Backend(Protocol):
    """The server behind the HTTP API. Every method may raise BackendError."""

    model_name: str          # the served model id: the only accepted `model` value
    max_model_len: int       # context length in tokens (0: unknown)
    # Optional: `default_max_tokens: int`, max_tokens for requests that give none (default 256).

    def generate(self, submit: TextSubmit) -> AsyncIterator[Output]:
        """Outputs for all `submit.n` sequences (interleaved, each with its `.index`), ending when
        every sequence has a finish_reason. `submit.reply_to` is b"": the backend fills it in.
        Closing the iterator before the end (the client went away) must abort the request."""
        ...

    async def query(self, stage: str, what: str, args: dict[str, Any]) -> Any:
        """Ask a stage for state, e.g. ("engine", "stats", {}) -> dict."""
        ...

    async def tokenize(self, *, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True, add_special_tokens: bool = True,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt or of chat messages rendered by the chat template
        (the fields of protocol.Tokenize)."""
        ...

    async def detokenize(self, *, ids: bytes, skip_special_tokens: bool = False) -> str:
        """Text of packed int32 token ids (the fields of protocol.Detokenize)."""
        ...

    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded" | "overloaded" | "shutting_down", ...anything else}."""
        ...
