"""What every message shares: the protocol version, the `Message` base (a `type` tag and `v`), and the
request parts that travel inside several messages (sampling, detokenization, the whole RequestSpec)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

__all__ = ["PROTOCOL_VERSION", "FinishReason", "ConstraintKind", "PoolingTask", "Constraint", "SamplingParams",
           "DetokSpec", "PoolingSpec", "RequestSpec", "Usage", "Message"]


PROTOCOL_VERSION = 2

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a sequence ended, everywhere from the engine to the client: a stop token or string, max_tokens,
an abort (a client, a stop string matched by the detokenizer, a pause), or a failure."""

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]
"""The grammar languages a Constraint may be written in."""

PoolingTask = Literal["embed", "reward", "classify"]
"""What a pooling model gives per input: an embedding, one reward scalar, or class logits."""

# --------------------------------------------------------------------------- shared parts

class Constraint(Struct, kw_only=True, forbid_unknown_fields=True):
    """A grammar the generated tokens must follow; each step samples only tokens that keep the
    text inside it (llguidance). `kind`: json_schema (`value` the schema as JSON text), json_object
    (any JSON object; `value` empty), regex, choice (`value` a JSON list of strings), lark or gbnf."""

    kind: ConstraintKind
    value: str = ""
    # the grammar begins after the model's reasoning (its thinking markers' end), not at the first token
    # (a chat request with thinking on; parallm/engine/think_gate.py)
    after_reasoning: bool = False


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
    constraint: Constraint | None = None    # a grammar the generated tokens must follow (structured output)


class DetokSpec(Struct, kw_only=True, forbid_unknown_fields=True):
    """What the detokenizer does for a request; a request without one gets token ids only."""

    stop: list[str] = []
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    token_strings: bool = False
    echo: bool = False
    assistant: bool = False         # chat: thinking text to Output.reasoning, the model's tool calls to Output.tool_calls
    tool_parser: str = ""           # with assistant: "" none, "auto" the model's own syntax, or a parser's name
    tools: list[dict[str, Any]] = []  # the request's tools (some parsers coerce argument types with them)


class PoolingSpec(Struct, kw_only=True, forbid_unknown_fields=True):
    """A pooling request: the prompt goes through the served pooling model `model` (model.pooling) in one
    prefill-only pass and its one output vector comes back in Output.pooled, instead of generated tokens."""

    model: str                      # the pooling model's served name
    task: PoolingTask = "embed"     # must be the model's task
    dimensions: int = 0             # embed: keep the first N components, renormalized (Matryoshka models only)


class RequestSpec(Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything a request asks for, whole. Whoever builds a request (ingress, a raw client) fills it
    once; it travels unchanged through the tokenizer to the engine (which wraps it in its Request)
    and, in Track, to the detokenizer. A new request field is added here, validated where requests
    are built (parallm/api for HTTP, the engine for everyone) and read where it acts: nowhere else."""

    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    n: int = 1
    detok: DetokSpec | None = None          # None: token ids only, no text
    adapter: str = ""                       # "" = the base model, unless the server has a default policy
    adapter_version: int = 0                # pin a version (0 = the latest when admitted)
    min_version: int = 0                    # the version must be at least this
    max_staleness: int = -1                 # a pinned version may lag the latest by at most this (-1: any)
    priority: int = 0                       # lower is served first (vLLM's convention); ties by arrival
    metadata: dict[str, Any] = {}           # echoed in the rollout stream
    submitted_at: float = 0.0               # the client's unix time, for timings
    pooling: PoolingSpec | None = None      # a pooling model's vector for the prompt instead of generation


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Message(Struct, tag_field="type", kw_only=True):
    v: int = PROTOCOL_VERSION
