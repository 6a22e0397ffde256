"""Every message that crosses a socket, as a closed typed struct, and the one codec for them.

Each message is a MessagePack map with a `type` tag and the protocol version `v`, so any
msgpack library can speak it (docs/protocol.md). Token id arrays travel as packed
little-endian int32 bytes and float arrays as packed little-endian float32 bytes.
Nothing else in parallm defines a wire message, and nothing is pickled.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
import numpy as np
from msgspec import Struct

PROTOCOL_VERSION = 1

FinishReason = Literal["stop", "length", "abort", "error"]


# --------------------------------------------------------------------------- packed arrays

def pack_ids(ids: Any) -> bytes:
    """Token ids (list, tuple or array) as packed little-endian int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def pack_floats(values: Any) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(data: bytes) -> list[float]:
    return np.frombuffer(data, dtype="<f4").tolist()


# --------------------------------------------------------------------------- shared parts

class SamplingParams(Struct, kw_only=True, forbid_unknown_fields=True):
    """How one request samples. Defaults sample from the model's own distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None


class DetokSpec(Struct, kw_only=True, forbid_unknown_fields=True):
    """What the detokenizer does for a request; a request without one gets token ids only."""

    stop: list[str] = []
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    token_strings: bool = False
    echo: bool = False


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Message(Struct, tag_field="type", kw_only=True):
    v: int = PROTOCOL_VERSION


# --------------------------------------------------------------------------- to the tokenizer

class TextSubmit(Message, tag="text_submit"):
    """A request in text (prompt or chat messages) or token ids, before tokenization."""

    rid: str
    reply_to: bytes
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_ids: bytes | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = {}
    add_special_tokens: bool = True
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    n: int = 1
    detok: DetokSpec | None = msgspec.field(default_factory=DetokSpec)
    stream: bool = True
    adapter: str = ""
    adapter_version: int = 0
    min_version: int = 0
    max_staleness: int = -1
    metadata: dict[str, Any] = {}
    submitted_at: float = 0.0


class Tokenize(Message, tag="tokenize"):
    qid: str
    reply_to: bytes
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] = {}


class Detokenize(Message, tag="detokenize"):
    qid: str
    reply_to: bytes
    ids: bytes
    skip_special_tokens: bool = False


# --------------------------------------------------------------------------- to the engine

class Submit(Message, tag="submit"):
    """A tokenized request. Raw ZeroMQ clients send this straight to the engine."""

    rid: str
    reply_to: bytes
    prompt_ids: bytes
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    n: int = 1
    detok: DetokSpec | None = None
    stream: bool = True
    adapter: str = ""
    adapter_version: int = 0
    min_version: int = 0
    max_staleness: int = -1
    metadata: dict[str, Any] = {}
    submitted_at: float = 0.0


class Score(Message, tag="score"):
    """Teacher-forced scoring: logprobs of ids[start:] given what precedes them, no sampling."""

    rid: str
    reply_to: bytes
    ids: bytes
    start: int = 1
    top_logprobs: int = 0
    adapter: str = ""
    adapter_version: int = 0


class Abort(Message, tag="abort"):
    """End requests (every sample of each rid), single samples (`sequences`: [rid, index]), or all."""

    rids: list[str] = []
    sequences: list[tuple[str, int]] = []
    all: bool = False
    reason: str = "abort"


class Pause(Message, tag="pause"):
    """Stop scheduling; 'keep' leaves sequences in place, 'abort' ends them with their partial tokens."""

    mode: Literal["keep", "abort"] = "keep"
    qid: str = ""
    reply_to: bytes = b""


class Resume(Message, tag="resume"):
    qid: str = ""
    reply_to: bytes = b""


class Query(Message, tag="query"):
    """Ask a stage for state (`what`: stats, adapters, policy, models, ...); the answer is a QueryReply."""

    qid: str
    reply_to: bytes
    what: str
    args: dict[str, Any] = {}


class AdapterPublish(Message, tag="adapter_publish"):
    """A new adapter version: weights inline (safetensors bytes) or a path readable by the engine."""

    name: str
    version: int = 0
    config: dict[str, Any] = {}
    weights: bytes = b""
    path: str = ""
    format: Literal["auto", "mlx", "peft"] = "auto"
    qid: str = ""
    reply_to: bytes = b""


class AdapterUnload(Message, tag="adapter_unload"):
    name: str
    qid: str = ""
    reply_to: bytes = b""


# --------------------------------------------------------------------------- to the detokenizer

class Track(Message, tag="track"):
    """Sent by the engine when it accepts a Submit, ahead of that request's outputs on one socket."""

    rid: str
    reply_to: bytes
    n: int
    prompt_ids: bytes
    detok: DetokSpec | None = None
    stream: bool = True
    adapter: str = ""
    stop_token_ids: list[int] = []
    min_tokens: int = 0
    metadata: dict[str, Any] = {}
    submitted_at: float = 0.0


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


class StepOutputs(Message, tag="step_outputs"):
    """Everything one engine step produced, for all rows: one message per step, or two when the
    step's prefill pass sampled first tokens (those go out before the decode pass runs)."""

    step: int
    time: float
    batch_size: int
    outputs: list[SeqDelta]


class RequestError(Message, tag="error"):
    """A request failed. `status` follows HTTP; `retryable` means the same request may succeed later."""

    rid: str
    reply_to: bytes = b""
    status: int = 400
    code: str = "invalid_request_error"
    message: str = ""
    param: str | None = None
    retryable: bool = False


class QueryReply(Message, tag="query_reply"):
    qid: str
    reply_to: bytes = b""
    ok: bool = True
    result: Any = None
    error: str = ""
    status: int = 200


# --------------------------------------------------------------------------- to clients

class Hello(Message, tag="hello"):
    """A client's first message on its DEALER: registers its identity with the router."""

    client: str = ""


class Welcome(Message, tag="welcome"):
    model: str
    protocol: int = PROTOCOL_VERSION
    addresses: dict[str, str] = {}
    policy: dict[str, int] = {}


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


# --------------------------------------------------------------------------- supervisor

class Ready(Message, tag="ready"):
    stage: str
    replica: int = 0
    pid: int = 0
    info: dict[str, Any] = {}


class Heartbeat(Message, tag="heartbeat"):
    stage: str
    replica: int = 0
    pid: int = 0
    stats: dict[str, Any] = {}


class Fatal(Message, tag="fatal"):
    """A stage cannot run (e.g. the model does not load); the supervisor stops with this message."""

    stage: str
    replica: int = 0
    message: str = ""


class StageDown(Message, tag="stage_down"):
    stage: str
    replica: int = 0
    restarts: int = 0


class StageUp(Message, tag="stage_up"):
    stage: str
    replica: int = 0
    restarts: int = 0


class Drain(Message, tag="drain"):
    deadline: float


class Shutdown(Message, tag="shutdown"):
    pass


# --------------------------------------------------------------------------- unions per receiver

TokenizerInbound = Union[TextSubmit, Tokenize, Detokenize, Query]
EngineInbound = Union[Submit, Score, Abort, Pause, Resume, Query, AdapterPublish, AdapterUnload]
DetokInbound = Union[Track, StepOutputs, RequestError, QueryReply]
ClientInbound = Union[Outputs, RequestError, QueryReply, Welcome]
RouterInbound = Union[Hello, Query]  # a client may ask the detokenizer for its stats
SupervisorInbound = Union[Ready, Heartbeat, Fatal]
ControlMessage = Union[StageDown, StageUp, Drain, Shutdown]
AnyMessage = Union[TextSubmit, Tokenize, Detokenize, Submit, Score, Abort, Pause, Resume, Query,
                   AdapterPublish, AdapterUnload, Track, StepOutputs, RequestError, QueryReply,
                   Hello, Welcome, Outputs, Rollout, TrainingStatus, Ready, Heartbeat, Fatal, StageDown, StageUp,
                   Drain, Shutdown]


class ProtocolError(ValueError):
    """A frame that is not a valid message for the socket it arrived on."""


_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


class Decoder:
    """Decodes frames into one of the message types a socket accepts; anything else is a ProtocolError."""

    def __init__(self, accepted: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(accepted)

    def decode(self, data: bytes) -> Any:
        try:
            message = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(str(exc)) from None
        if message.v != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {message.v} is not supported (this server speaks "
                                f"{PROTOCOL_VERSION})")
        return message


def decode(data: bytes, accepted: Any = AnyMessage) -> Any:
    return Decoder(accepted).decode(data)
