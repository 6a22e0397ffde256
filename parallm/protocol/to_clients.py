"""What clients receive on their DEALER (Welcome, each step's Outputs), and what a stage publishes for
trainers (Rollout) or a trainer pushes to ingress (TrainingStatus)."""

from __future__ import annotations

from typing import Any, Literal, Union

from msgspec import Struct

from .base import PROTOCOL_VERSION, FinishReason, Message, Usage
from .replies import AnyReply, PolicyActReply, PolicyList, PredictReply, StatsReply
from .to_detokenizer import RequestError

__all__ = ["Welcome", "Output", "Outputs", "Rollout", "TrainingStatus", "ClientInbound", "PolicyClientInbound"]


class Welcome(Message, tag="welcome"):
    model: str
    protocol: int = PROTOCOL_VERSION
    addresses: dict[str, str] = {}


class Output(Struct, kw_only=True, omit_defaults=True):
    """What a client receives for one sequence: new tokens, their text and logprobs (defaults left out)."""

    rid: str
    index: int = 0
    token_ids: bytes = b""
    text: str = ""
    logprobs: bytes = b""
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    tokens: list[str] = []
    top_tokens: list[str] = []
    adapter: str = ""
    version: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    prompt_text: str | None = None
    prompt_ids: bytes = b""
    prompt_logprobs: bytes = b""
    prompt_tokens: list[str] = []
    prompt_top_ids: bytes = b""
    prompt_top_logprobs: bytes = b""
    prompt_top_tokens: list[str] = []
    prompt_ranks: bytes = b""                     # int32 per prompt position (0: none): vLLM's rank
    pooled: bytes = b""                           # RequestSpec.pooling: the output vector, packed float32
    reasoning: str = ""                           # DetokSpec.assistant: thinking text (left out of `text`)
    tool_calls: list[dict[str, Any]] = []         # DetokSpec.assistant: complete calls {id, type, function}
    # DetokSpec.assistant: the calls as OpenAI delta.tool_calls fragments ({index, id, type, function: {name,
    # arguments}} first, then {index, function: {arguments}} pieces), accumulating to tool_calls
    tool_call_deltas: list[dict[str, Any]] = []


class Outputs(Message, tag="outputs"):
    """All outputs for one client from one engine step."""

    items: list[Output]
    batch_size: int = 0


class Rollout(Message, tag="rollout"):
    """A finished sequence, published for trainers (topic: adapter name, '' for the base)."""

    rid: str
    index: int
    prompt_ids: bytes
    completion_ids: bytes
    logprobs: bytes
    adapter: str = ""
    versions: list[tuple[int, int]] = []
    finish_reason: FinishReason | None = None
    metadata: dict[str, Any] = {}
    text: str = ""
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0


class TrainingStatus(Message, tag="training_status"):
    """A trainer's state after each step, pushed to ingress (GET /v1/training/status, /metrics)."""

    trainer: str
    adapter: str
    state: Literal["starting", "running", "stopped", "failed"] = "running"
    step: int = 0
    version: int = 0
    steps_planned: int = 0
    last: dict[str, Any] = {}           # the latest step's metrics (loss, reward_mean, ...)
    totals: dict[str, Any] = {}         # counters since the trainer (re)started its run
    staleness_hist: dict[str, int] = {}
    resumed_from: str = ""
    error: str = ""
    updated_at: float = 0.0


ClientInbound = Union[Outputs, RequestError, Welcome, AnyReply]
"""What a client's DEALER accepts from the detokenizer's ROUTER."""
PolicyClientInbound = Union[PolicyActReply, PredictReply, PolicyList, StatsReply, RequestError]
"""What a DEALER on the policy stage's ROUTER accepts."""
