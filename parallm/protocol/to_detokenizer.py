"""The messages the detokenizer receives from the engine: a request's Track, each step's outputs, and
errors (every stage routes a request's error to its client through the detokenizer)."""

from __future__ import annotations

from typing import Union

from msgspec import Struct

from .base import FinishReason, Message, RequestSpec, Usage
from .replies import AnyReply
from .to_tokenizer import GetStats

__all__ = ["Track", "SeqDelta", "StepOutputs", "RequestError", "Hello", "DetokInbound", "RouterInbound"]


class Track(Message, tag="track"):
    """Sent by the engine when it accepts a Submit, ahead of that request's outputs on one socket."""

    rid: str
    reply_to: bytes
    prompt_ids: bytes
    spec: RequestSpec
    replica: int = 0  # the engine replica that holds it: its death fails only its own requests


class SeqDelta(Struct, kw_only=True, omit_defaults=True):
    """New tokens of one sequence from one engine step (fields at their default are left out)."""

    rid: str
    index: int = 0
    token_ids: bytes = b""
    logprobs: bytes = b""
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    adapter: str = ""
    version: int = 0
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_logprobs: bytes = b""
    prompt_top_ids: bytes = b""
    prompt_top_logprobs: bytes = b""
    prompt_ranks: bytes = b""          # int32 per prompt position, 0 for the first: vLLM's rank of the prompt token
    pooled: bytes = b""                # a pooling request's output vector (float32), with its finish_reason


class StepOutputs(Message, tag="step_outputs"):
    """Everything one engine step produced, for all rows: one message per step, or two when the
    step's prefill pass sampled first tokens (those go out before the decode pass runs)."""

    step: int
    time: float
    batch_size: int
    outputs: list[SeqDelta]


class RequestError(Message, tag="error"):
    """A request failed (`rid`), or a control request did (`rid` = its qid). `status` follows HTTP;
    `retryable` means the same request may succeed later."""

    rid: str
    reply_to: bytes = b""
    status: int = 400
    code: str = "invalid_request_error"
    message: str = ""
    param: str | None = None
    retryable: bool = False


class Hello(Message, tag="hello"):
    """A client's first message on its DEALER: registers its identity with the router."""

    client: str = ""


DetokInbound = Union[Track, StepOutputs, RequestError, AnyReply]
"""What the detokenizer's PULL socket accepts: the engine's messages, and every stage's replies and errors."""
RouterInbound = Union[Hello, GetStats]
"""What the detokenizer's ROUTER accepts from a client (a client may ask the detokenizer for its stats)."""
