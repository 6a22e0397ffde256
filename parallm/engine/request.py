"""What goes into the engine core and what comes out of it (in-process types, not wire messages)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from parallm.protocol import FinishReason, RequestSpec, SamplingParams, Usage

TopLogprobs = list[list[tuple[int, float]]]


class RequestRejected(ValueError):
    """The request can never be served as given (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str = "",
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status  # 404: unknown adapter or version; 409: the policy version is not available
        self.code = code
        self.retryable = retryable  # the same request may succeed later (503 kv_pressure: Retry-After)


@dataclass(slots=True)
class Request:
    """A tokenized generation request: its id and prompt, and what the client asked for (the
    protocol's RequestSpec, whole). The `n` sequences of a request share the prompt (prefilled once)."""

    rid: str
    prompt_ids: list[int]
    spec: RequestSpec
    images: list[Any] = field(default_factory=list)  # numpy pixel values, one per image run in the prompt (images.py)

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def n(self) -> int:
        return self.spec.n


def make_request(rid: str, prompt_ids: Sequence[int], params: SamplingParams | None = None, **spec: Any) -> Request:
    """A Request from its parts, for in-process callers (tests, benchmarks): `spec` holds the
    RequestSpec fields other than params (n, adapter, priority, ...)."""
    return Request(rid, list(prompt_ids), RequestSpec(params=params or SamplingParams(), **spec))


@dataclass(slots=True)
class SeqOutput:
    """New tokens of one sequence from one `Engine.step()`.

    A finishing sequence's last token is included, stop tokens too (vLLM semantics: the
    detokenizer hides them). `prompt_logprobs` rides on the first output of index 0 only:
    one entry per prompt position, the first None.
    """

    rid: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: TopLogprobs | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # vLLM's rank of each prompt token (1 = the most likely)
    adapter: str = ""  # the adapter and version that produced these tokens
    version: int = 0


@dataclass(slots=True)
class ScoreResult:
    """A finished score request (`Engine.add_score`), returned by the `step()` that finished it:
    teacher-forced logprobs of ids[start:], each given the ids before it, with top-k alternatives
    (best first) when asked. `aborted`: it was aborted before it was done (no logprobs)."""

    qid: str
    ids: list[int]
    start: int
    logprobs: list[float]
    top_logprobs: TopLogprobs | None = None
    aborted: bool = False


def validate(request: Request, *, vocab_size: int, max_model_len: int, max_num_seqs: int,
             max_logprobs: int = 20) -> None:
    """Raise RequestRejected for input no engine state could serve. `max_logprobs`: vLLM's --max-logprobs
    (server.max_logprobs; -1 = the vocabulary size)."""
    p = request.params
    ids = request.prompt_ids
    if not isinstance(request.rid, str) or not request.rid:
        raise RequestRejected("request id must be a non-empty string", "rid")
    if len(ids) == 0:
        raise RequestRejected("prompt is empty", "prompt")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in ids):
        raise RequestRejected(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    if not 1 <= request.n <= max_num_seqs:
        raise RequestRejected(f"n must be between 1 and {max_num_seqs}", "n")
    if p.max_tokens < 1:
        raise RequestRejected("max_tokens must be at least 1", "max_tokens")
    if len(ids) + p.max_tokens > max_model_len:
        raise RequestRejected(
            f"prompt ({len(ids)} tokens) plus max_tokens ({p.max_tokens}) exceeds the model's "
            f"context length of {max_model_len} tokens", "max_tokens", code="context_length_exceeded")
    _finite(p.temperature, "temperature")
    if p.temperature < 0:
        raise RequestRejected("temperature must be >= 0", "temperature")
    _finite(p.top_p, "top_p")
    if not 0 < p.top_p <= 1:
        raise RequestRejected("top_p must be in (0, 1]", "top_p")
    if p.top_k < 0:
        raise RequestRejected("top_k must be >= 0 (0 disables it)", "top_k")
    _finite(p.min_p, "min_p")
    if not 0 <= p.min_p <= 1:
        raise RequestRejected("min_p must be in [0, 1]", "min_p")
    _finite(p.repetition_penalty, "repetition_penalty")
    if p.repetition_penalty <= 0:
        raise RequestRejected("repetition_penalty must be > 0", "repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _finite(value, name)
        if not -2.0 <= value <= 2.0:
            raise RequestRejected(f"{name} must be in [-2, 2]", name)
    for tok, bias in p.logit_bias.items():
        if not 0 <= int(tok) < vocab_size:
            raise RequestRejected(f"logit_bias token {tok} is outside the vocabulary", "logit_bias")
        if not math.isfinite(bias) or not -100 <= bias <= 100:
            raise RequestRejected("logit_bias values must be in [-100, 100]", "logit_bias")
    if any(not 0 <= t < vocab_size for t in p.stop_token_ids):
        raise RequestRejected("stop_token_ids must be inside the vocabulary", "stop_token_ids")
    if p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        raise RequestRejected("min_tokens must be in [0, max_tokens]", "min_tokens")
    if p.constraint is not None:
        if p.min_tokens:
            raise RequestRejected("min_tokens cannot be combined with a grammar constraint (the grammar "
                                  "decides where the output ends)", "min_tokens")
        if p.ignore_eos:
            raise RequestRejected("ignore_eos cannot be combined with a grammar constraint (the grammar "
                                  "ends the output with EOS)", "ignore_eos")
    _check_logprobs(p.top_logprobs, p.prompt_logprobs, vocab_size if max_logprobs == -1 else max_logprobs)
    if p.seed is not None and not -(2**63) <= p.seed < 2**64:
        raise RequestRejected("seed must fit in 64 bits", "seed")
    priority = request.spec.priority
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) <= priority < 2**31:
        raise RequestRejected("priority must be an integer in [-2147483648, 2147483647] (lower is served first)",
                              "priority")


def validate_score(ids: Sequence[int], start: int, top_logprobs: int, *, vocab_size: int,
                   max_model_len: int) -> None:
    if len(ids) < 2:
        raise RequestRejected("scoring needs at least two token ids", "ids")
    if len(ids) > max_model_len:
        raise RequestRejected(f"{len(ids)} ids exceed the context length of {max_model_len}", "ids",
                              code="context_length_exceeded")
    if not 1 <= start < len(ids):
        raise RequestRejected(f"start must be in [1, {len(ids) - 1}]", "start")
    if any(not 0 <= int(t) < vocab_size for t in ids):
        raise RequestRejected(f"token ids must be in [0, {vocab_size})", "ids")
    if not 0 <= top_logprobs <= 20:
        raise RequestRejected("top_logprobs must be in [0, 20]", "top_logprobs")


def _check_logprobs(top_logprobs: int, prompt_logprobs: int | None, most: int) -> None:
    """vLLM's bounds and messages (SamplingParams._validate_logprobs)."""
    if top_logprobs < 0:
        raise RequestRejected("top_logprobs must be >= 0", "top_logprobs")
    if top_logprobs > most:
        raise RequestRejected(f"Requested sample logprobs of {top_logprobs}, which is greater than max allowed: "
                              f"{most} (the server's --server.max-logprobs)", "top_logprobs")
    if prompt_logprobs is not None and prompt_logprobs < 0:
        raise RequestRejected("prompt_logprobs must be >= 0", "prompt_logprobs")
    if prompt_logprobs is not None and prompt_logprobs > most:
        raise RequestRejected(f"Requested prompt logprobs of {prompt_logprobs}, which is greater than max allowed: "
                              f"{most} (the server's --server.max-logprobs)", "prompt_logprobs")


def _finite(value: float, name: str) -> None:
    if not math.isfinite(value):
        raise RequestRejected(f"{name} must be a finite number", name)
