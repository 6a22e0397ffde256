"""What the HTTP layer needs from the rest of the server: one small async interface.

The ingress stage implements it over ZeroMQ (stages/ingress.py); tests implement it with a
scripted object. Nothing in parallm.api imports ZeroMQ or MLX.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Literal, Protocol, runtime_checkable

from parallm.pooling.spec import PoolingInfo
from parallm.protocol import (AdapterList, AdapterLoaded, AdapterPublish, AdapterUnloaded, Detokenize, EngineStats,
                              Output, PauseState, PrefixCacheReset, TextSubmit, Tokenize, WeightsUpdate,
                              WeightsUpdated)


class BackendError(Exception):
    """A request failed behind the HTTP layer; becomes an OpenAI error response.

    `status` is the HTTP status (400: the request is at fault, e.g. the prompt is too long;
    503: a stage is down), `code` the OpenAI error code, `param` the offending request field,
    `retryable` whether the same request may succeed later (adds `Retry-After`). `prompt`: the index of
    the request's prompt (its TextSubmit) whose failure this is, when `merge.merged` knows it.
    """

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.param, self.retryable = param, retryable
        self.prompt: int | None = None


@runtime_checkable
class Backend(Protocol):
    """The server behind the HTTP API: every member the routes use. Every method may raise
    BackendError. The ingress stage implements it over the pipeline (stages/ingress.py); the API
    tests implement it with a scripted object."""

    model_name: str          # the served model id: the only accepted `model` value
    max_model_len: int       # context length in tokens (0: unknown)
    default_max_tokens: int  # max_tokens for requests that give none
    sampling_defaults: dict[str, float]  # OpenAI routes: SamplingParams fields a request omits (generation_config)
    max_n: int               # samples per prompt the engine decodes together (engine.max_num_seqs)
    max_constraint_bytes: int  # largest grammar constraint text a request may carry (engine.max_constraint_bytes)
    last_batch_size: int     # the engine's decode batch size in the latest outputs (RL /generate metadata)
    pooling_models: dict[str, PoolingInfo]  # model.pooling's models by served name (the pooling routes)

    def generate(self, submit: TextSubmit) -> AsyncIterator[Output]:
        """Outputs for all `submit.spec.n` sequences (interleaved, each with its `.index`), ending when
        every sequence has a finish_reason. `submit.reply_to` is b"": the backend fills it in.
        Closing the iterator before the end (the client went away) must abort the request."""
        ...

    async def tokenize(self, request: Tokenize) -> list[int]:
        """Token ids of a prompt or of chat messages rendered by the chat template."""
        ...

    async def detokenize(self, request: Detokenize) -> str:
        """Text of packed int32 token ids."""
        ...

    async def engine_stats(self) -> EngineStats:
        ...

    async def pause(self, mode: Literal["keep", "abort"]) -> PauseState:
        ...

    async def resume(self) -> PauseState:
        ...

    async def abort(self, rids: list[str], *, all: bool = False) -> None:
        """End requests by engine request id (or every request); nothing is awaited."""
        ...

    async def load_adapter(self, request: AdapterPublish) -> AdapterLoaded:
        """The same message a trainer publishes, answered by the engine once it is loaded."""
        ...

    async def unload_adapter(self, name: str) -> AdapterUnloaded:
        ...

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        """Forget the free prefix-cache blocks (running sequences keep theirs)."""
        ...

    async def update_weights(self, request: WeightsUpdate) -> WeightsUpdated:
        """A full-weight update of the base model (a checkpoint directory), answered once applied."""
        ...

    async def list_adapters(self) -> AdapterList:
        ...

    def training_status(self) -> dict[str, Any]:
        """What each trainer last reported (GET /v1/training/status)."""
        ...

    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded" | "overloaded" | "shutting_down", ...anything else}."""
        ...
