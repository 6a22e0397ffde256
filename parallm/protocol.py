"""Every message that crosses a socket, as a closed typed struct, and the one codec for them.

Each message is a MessagePack map with a `type` tag and the protocol version `v`, so any
msgpack library can speak it (docs/protocol.md). Token id arrays travel as packed
little-endian int32 bytes and float arrays as packed little-endian float32 bytes.
Nothing else in parallm defines a wire message, and nothing is pickled.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence, Union

import msgspec
import numpy as np
from msgspec import Struct

from .config import AdaptersConfig, EngineConfig

PROTOCOL_VERSION = 2

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a sequence ended, everywhere from the engine to the client: a stop token or string, max_tokens,
an abort (a client, a stop string matched by the detokenizer, a pause), or a failure."""

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]
"""The grammar languages a Constraint may be written in."""


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


def count_ids(data: bytes) -> int:
    """How many ids (or floats) a packed array holds."""
    return len(data) // 4


TopRow = list[tuple[int, float]]


def pack_top(rows: Sequence[Sequence[tuple[int, float]]]) -> tuple[bytes, bytes]:
    """Top-k alternatives of several positions (each a list of (token id, logprob)), flattened
    row-major into packed ids and logprobs; every row must have the same k."""
    return pack_ids([t for row in rows for t, _ in row]), pack_floats([lp for row in rows for _, lp in row])


def unpack_top(ids: bytes, logprobs: bytes, rows: int) -> list[TopRow]:
    """The inverse of `pack_top` for `rows` positions (k = entries / rows); [] when there are none."""
    flat_ids, flat_lps = unpack_ids(ids), unpack_floats(logprobs)
    if not rows or not flat_ids:
        return []
    k = len(flat_ids) // rows
    return [list(zip(flat_ids[r * k:(r + 1) * k], flat_lps[r * k:(r + 1) * k])) for r in range(rows)]


VersionSpans = list[tuple[int, int]]
"""[(index of the first token, policy version), ...]: which version produced which tokens of a sample."""


def extend_spans(spans: VersionSpans, first_token: int, version: int) -> None:
    """Record that tokens from `first_token` on were produced by `version` (a new span only when the
    version changes)."""
    if not spans or spans[-1][1] != version:
        spans.append((first_token, version))


def version_at(spans: VersionSpans, position: int) -> int:
    """The policy version that produced token `position` (0 before the first span)."""
    version = 0
    for start, v in spans:
        if start > position:
            break
        version = v
    return version


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
    spec: RequestSpec = msgspec.field(default_factory=RequestSpec)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_ids: bytes | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = {}
    add_special_tokens: bool = True


class Tokenize(Message, tag="tokenize"):
    """Token ids of a prompt, or of chat messages rendered by the chat template; answered by TokenizeReply."""

    qid: str
    reply_to: bytes
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] = {}


class Detokenize(Message, tag="detokenize"):
    """Text of packed token ids; answered by DetokenizeReply."""

    qid: str
    reply_to: bytes
    ids: bytes
    skip_special_tokens: bool = False


class GetStats(Message, tag="get_stats"):
    """Ask a stage (the engine, a tokenizer, or the detokenizer through the router) for its StatsReply."""

    qid: str
    reply_to: bytes = b""


# --------------------------------------------------------------------------- to the engine

class Submit(Message, tag="submit"):
    """A tokenized request. Raw ZeroMQ clients send this straight to the engine."""

    rid: str
    reply_to: bytes
    prompt_ids: bytes
    spec: RequestSpec = msgspec.field(default_factory=RequestSpec)


class Score(Message, tag="score"):
    """Teacher-forced scoring: logprobs of ids[start:] given what precedes them, no sampling.
    Runs as prefill work in the engine's steps (batched, through the prefix cache); answered by
    ScoreReply."""

    qid: str
    reply_to: bytes
    ids: bytes
    start: int = 1
    top_logprobs: int = 0
    adapter: str = ""
    adapter_version: int = 0


class Abort(Message, tag="abort"):
    """End requests (every sample of each rid), single samples (`sequences`: [rid, index]), or all.
    `reason` becomes the sequences' finish reason, so it is one of FinishReason. Unanswered when it
    works; an abort the codec rejects is answered with RequestError (rid = `qid`) when it names `reply_to`."""

    rids: list[str] = []
    sequences: list[tuple[str, int]] = []
    all: bool = False
    reason: FinishReason = "abort"
    qid: str = ""
    reply_to: bytes = b""


class Pause(Message, tag="pause"):
    """Stop scheduling; 'keep' leaves sequences in place, 'abort' ends them with their partial tokens.
    Answered by PauseState when `qid` is set."""

    mode: Literal["keep", "abort"] = "keep"
    qid: str = ""
    reply_to: bytes = b""


class Resume(Message, tag="resume"):
    """Schedule again; after a 'keep' pause, unpinned sequences move to their adapter's latest version."""

    qid: str = ""
    reply_to: bytes = b""


class AdapterPublish(Message, tag="adapter_publish"):
    """A new adapter version: weights inline (safetensors bytes) or a path readable by the engine.
    Answered by AdapterLoaded when `qid` is set (trainers publishing on the PUB socket set none)."""

    name: str
    version: int = 0
    config: dict[str, Any] = {}
    weights: bytes = b""
    path: str = ""
    format: Literal["auto", "mlx", "peft"] = "auto"
    make_default: bool = False  # requests that name no adapter run under this one from now on
    qid: str = ""
    reply_to: bytes = b""


class WeightsUpdate(Message, tag="weights_update"):
    """A full-weight policy update of the base model (docs/rl.md): a directory of safetensors files
    readable by the engine (`path`, HF or mlx-lm tensor names), or chunk `chunk` of `chunks` of inline
    safetensors bytes (`weights`, about a layer each) sent by a trainer on the PUB socket under one
    `update_id`. Chunks are checked and staged as they come; the update is applied at a step boundary,
    one layer at a time, once the last chunk is in (one that fails midway changes nothing:
    EngineStats.weights says why). The update becomes policy version `version` (0: the current + 1) of
    the base model; the prefix cache is invalidated. Answered by WeightsUpdated when `qid` is set."""

    path: str = ""
    weights: bytes = b""
    update_id: str = ""
    chunk: int = 0
    chunks: int = 1
    version: int = 0
    qid: str = ""
    reply_to: bytes = b""


class ResetPrefixCache(Message, tag="reset_prefix_cache"):
    """Forget every free prefix-cache block (vLLM's /reset_prefix_cache, SGLang's /flush_cache); blocks
    held by running sequences stay theirs. Answered by PrefixCacheReset when `qid` is set."""

    qid: str = ""
    reply_to: bytes = b""


class AdapterUnload(Message, tag="adapter_unload"):
    """Forget every version of an adapter; answered by AdapterUnloaded when `qid` is set."""

    name: str
    qid: str = ""
    reply_to: bytes = b""


class ListAdapters(Message, tag="list_adapters"):
    """Every loaded adapter and the policy (latest version per name); answered by AdapterList."""

    qid: str
    reply_to: bytes


# --------------------------------------------------------------------------- to the detokenizer

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


# --------------------------------------------------------------------------- replies (routed to `reply_to`)

class Reply(Message, kw_only=True):
    """A stage's answer to one control request, routed by the detokenizer to `reply_to`. A request
    that fails is answered by RequestError instead, with its qid as `rid`."""

    qid: str
    reply_to: bytes = b""


class TokenizeReply(Reply, tag="tokenize_reply"):
    ids: bytes


class DetokenizeReply(Reply, tag="detokenize_reply"):
    text: str


class ScoreReply(Reply, tag="score_reply"):
    """Per scored position: the logprob of the given token, and top-k alternatives when asked
    (flattened row-major, `unpack_top`)."""

    logprobs: bytes
    top_ids: bytes = b""
    top_logprobs: bytes = b""


class PauseState(Reply, tag="pause_state"):
    paused: bool
    mode: Literal["keep", "abort"] = "keep"
    moved_to_latest: int = 0    # sequences moved to their adapter's latest version by a resume


class AdapterVersion(Struct, kw_only=True):
    version: int
    kind: str                   # "lora" or "dora"
    format: str                 # "mlx" or "peft"
    rank: int
    modules: int
    bytes: int
    merged: bool = False
    source: str = "inline"
    loaded_at: float = 0.0


class AdapterInfo(Struct, kw_only=True):
    name: str
    latest: int
    bytes: int
    versions: list[AdapterVersion] = []


class AdapterLoaded(Reply, tag="adapter_loaded"):
    name: str
    version: int
    bytes: int = 0
    load_ms: float = 0.0
    merged: bool = False
    default: bool = False       # it became the server's default policy (see docs/rl.md)


class AdapterUnloaded(Reply, tag="adapter_unloaded"):
    name: str
    versions_removed: int


class WeightsUpdated(Reply, tag="weights_updated"):
    version: int                # the base model's policy version now (the previous one until `complete`)
    tensors: int = 0            # tensors applied by this message
    load_ms: float = 0.0
    complete: bool = True       # false: a chunk of an update still waiting for its later chunks


class PrefixCacheReset(Reply, tag="prefix_cache_reset"):
    dropped: int = 0            # blocks forgotten
    held: int = 0               # blocks still held by running sequences


class AdapterList(Reply, tag="adapter_list"):
    adapters: list[AdapterInfo] = []
    policy: dict[str, int] = {}  # latest version per adapter name; "" (the base model) is 0
    adapter_bytes: int = 0
    default_adapter: str = ""    # what requests naming no adapter run under ("" = the base model)


# --------------------------------------------------------------------------- stats

class AdapterStats(Struct, kw_only=True):
    loaded: int = 0                     # adapter names with a version
    versions_kept: int = 0
    bytes: int = 0
    stack_bytes: int = 0                # stacked weights of mixed-adapter passes
    publishes: int = 0                  # versions loaded while serving
    rejected: int = 0
    latest: dict[str, int] = {}         # latest version per name
    passes: dict[str, int] = {}         # passes by kind (merged, factored, mixed, ...)
    load_to_first_token_ms: float | None = None  # median over the last 64 versions


class RankState(Struct, kw_only=True):
    """A tensor-parallel rank's state as rank 0 last confirmed it (parallm/engine/distributed.py): the
    rank's state digest, sent in its ack of rank 0's calls, equalled rank 0's at rank 0's step `step`."""

    rank: int = 0
    step: int = 0
    agrees: bool = True
    policy: dict[str, int] = {}  # adapter name -> the latest version it serves ("": the base weights' version)


class WeightsStatus(Struct, kw_only=True):
    """Chunked full-weight updates over the trainer's PUB socket, as the engine stage sees them (docs/rl.md):
    the one being received (staged, not applied: the served weights change only once every chunk is in) and
    why the last one was refused. A PUB publisher gets no reply: this is how it learns the outcome."""

    receiving: str = ""          # update id of the update being received ("" = none)
    received: int = 0            # its chunks received so far
    chunks: int = 0              # of this many
    rejected: int = 0            # updates refused or abandoned since start (the served weights unchanged)
    last_error: str = ""         # why the last one was: "<update id>: <reason>"
    last_error_code: str = ""    # e.g. chunk_missing, chunk_timeout, shape_mismatch, invalid_weights
    last_error_at: float = 0.0   # unix time


class LoopStats(Struct, kw_only=True):
    """Where a stage's loop spends its working iterations."""

    steps: int = 0
    ms_mean: dict[str, float] = {}


class BlasStats(Struct, kw_only=True):
    threads: int
    others_busy_cores: float
    thread_changes: int


class StepRecord(Struct, kw_only=True):
    """One engine step (parallm/engine/trace.py): what it ran and where its time went."""

    step: int = 0
    ms: float = 0.0
    kind: str = ""                # decode, prefill, prefill+decode, mixed, read
    decode_rows: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0       # real prompt tokens of the step's prefill pass
    prefill_padded: int = 0       # rows x padded chunk length L
    prefill_length: int = 0       # L
    prefill_span: int = 0         # key positions the prefill pass attends (its longest start + L)
    admitted: int = 0
    preempted: int = 0
    new_shape: bool = False       # the first step of this (kind, decode rows, prefill rows, L)
    new_prefill_shape: bool = False  # its prefill pass is the first of this (rows, L, span, live capacity)
    phase_ms: dict[str, float] = {}  # schedule (with row ops), prefill, launch, read, mixed
    ops: dict[str, int] = {}      # row operations run, by kind (Resize, CopyRow, WriteBack, ...)


class BurstStats(Struct, kw_only=True):
    """The engine's steps from the first one after it had nothing to do to the one that left it with
    nothing (parallm/engine/trace.py): a benchmark run's figures, read after the run."""

    done: bool = False
    first_step: int = 0
    steps: int = 0
    wall_s: float = 0.0
    step_ms_p50: float = 0.0
    step_ms_p99: float = 0.0
    step_ms_max: float = 0.0
    passes: dict[str, int] = {}   # steps by what they ran (StepRecord.kind)
    phase_ms: dict[str, float] = {}
    ops: dict[str, int] = {}
    prefill_passes: int = 0
    prefill_tokens_per_pass: float = 0.0
    prefill_padded_per_pass: float = 0.0
    new_shapes: int = 0           # steps whose pass shape the engine ran for the first time (a GPU compiles)
    new_shape_ms: float = 0.0
    # prefill passes (or mixed passes) by whether their (rows, L, span, capacity) was new: count and the time
    # of their prefill (or mixed) phase, so a new shape's own cost is the difference of the means
    new_prefill_shapes: int = 0
    new_prefill_ms: float = 0.0
    known_prefill_passes: int = 0
    known_prefill_ms: float = 0.0
    admitted: int = 0
    preempted: int = 0
    max_decode_rows: int = 0
    slowest: list[StepRecord] = []


class EngineStats(Struct, tag="engine", kw_only=True):
    """The engine's state and counters since it started (GetStats; ingress polls it for /metrics)."""

    replica: int = 0  # which data-parallel engine replica (engine.replicas) answered
    running: int = 0
    waiting: int = 0
    prefilling: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    kv_budget_bytes: int = 0
    live_token_slots: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evictions: int = 0
    preemptions: int = 0
    priority_preemptions: int = 0       # of those, made room for a request of better priority
    steps: int = 0
    mixed_passes: int = 0
    decode_batch_hist: dict[int, int] = {}
    max_decode_batch: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    scored_tokens: int = 0
    step_ms_mean: dict[str, float] = {}
    live_rows: int = 0
    live_capacity: int = 0
    live_bytes: int = 0
    pool_bytes: int = 0
    bytes_per_token: int = 0
    penalty_state: bool = False
    compiled_decode: dict[str, int] = {}  # engine.compiled_decode: passes run compiled, traces, eager_<reason> fallbacks
    adapters: AdapterStats = msgspec.field(default_factory=AdapterStats)
    settings: EngineConfig | None = None  # the engine settings, with every unset one resolved
    adapter_settings: AdaptersConfig | None = None
    weights_version: int = 0      # the base model's policy version (full-weight updates applied)
    weights_updates: int = 0
    recomputed_tokens: int = 0    # computed tokens preemptions threw away (recomputed when readmitted)
    oom_retries: int = 0          # allocations retried after freeing MLX's buffer cache (engine/memory.py)
    burst: BurstStats | None = None       # the steps of the work in progress (engine/trace.py)
    last_burst: BurstStats | None = None  # the last burst of steps that ended with nothing left to do
    # the engine stage's own
    weights: WeightsStatus = msgspec.field(default_factory=WeightsStatus)
    paused: bool = False
    held_for_version: int = 0
    received: int = 0
    dropped_frames: int = 0
    loop: LoopStats = msgspec.field(default_factory=LoopStats)
    blas: BlasStats | None = None
    ranks: list[RankState] = []    # a tensor-parallel group's ranks, rank 0 first (engine.tensor_parallel > 1)
    replicas: list[EngineStats] = []  # replica 0's answer: the other replicas' latest stats (engine.replicas > 1)


class TokenizerStats(Struct, tag="tokenizer", kw_only=True):
    handled: int = 0
    rejected: int = 0
    failed: int = 0
    dropped_frames: int = 0
    routed: list[int] = []  # requests sent to each engine replica (parallm/routing.py)
    affinity_hits: int = 0  # of those, sent to a replica for its cached prefix
    down: list[int] = []  # engine replicas it sends nothing to: dead, or remote ones not yet heard from


class DetokenizerStats(Struct, tag="detokenizer", kw_only=True):
    in_flight: int = 0
    batch_size: int = 0
    outputs: int = 0
    errors: int = 0
    unroutable: int = 0
    unreachable: int = 0
    dropped_frames: int = 0
    failed_messages: int = 0
    stop_string_aborts: int = 0
    client_gone_aborts: int = 0
    rollouts_published: int = 0
    rollouts_dropped: int = 0


StageStats = Union[EngineStats, TokenizerStats, DetokenizerStats]


class StatsReply(Reply, tag="stats_reply"):
    stats: StageStats


class ReplicaStats(Message, tag="replica_stats"):
    """Engine replica i > 0's stats, pushed to replica 0 about every second (parallm/routing.py), which
    answers GetStats with them in EngineStats.replicas."""

    replica: int
    stats: EngineStats
    pid: int = 0  # its process (a remote replica's liveness and restarts reach the supervisor through replica 0)


# --------------------------------------------------------------------------- to clients

class Hello(Message, tag="hello"):
    """A client's first message on its DEALER: registers its identity with the router."""

    client: str = ""


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
    reasoning: str = ""                           # DetokSpec.assistant: thinking text (left out of `text`)
    tool_calls: list[dict[str, Any]] = []         # DetokSpec.assistant: complete calls {id, type, function}
    # DetokSpec.assistant: the calls as OpenAI delta.tool_calls fragments ({index, id, type, function: {name,
    # arguments}} first, then {index, function: {arguments}} pieces), accumulating to tool_calls
    tool_call_deltas: list[dict[str, Any]] = []


class Outputs(Message, tag="outputs"):
    """All outputs for one client from one engine step."""

    items: list[Output]
    batch_size: int = 0


def coalesce_outputs(items: Sequence[Output]) -> list[Output]:
    """Consecutive outputs of one sequence merged into one, for a reader that fell behind (several
    steps' outputs waiting): variable-length fields (token ids, text, logprobs, per-token lists)
    concatenate; any other field is taken where only one side sets it; outputs that disagree on one
    (another sample, another policy version) or follow a finished one stay apart."""
    merged: list[Output] = []
    for item in items:
        last = merged[-1] if merged else None
        combined = _merged(last, item) if last is not None and last.finish_reason is None else None
        if combined is None:
            merged.append(item)
        else:
            merged[-1] = combined
    return merged


_OUTPUT_IDENTITY = ("rid", "index", "adapter", "version")  # equal in outputs that merge
# (name, default, is identity) of every Output field, in order (read once: fields() builds new objects)
_OUTPUT_FIELDS = tuple((f.name, f.default if f.default is not msgspec.NODEFAULT else None, f.name in _OUTPUT_IDENTITY)
                       for f in msgspec.structs.fields(Output))
_CONCATENATED = (bytes, str, list)


def _merged(a: Output, b: Output) -> Output | None:
    if a.rid != b.rid or a.index != b.index or a.adapter != b.adapter or a.version != b.version:
        return None
    values: dict[str, Any] = {}
    for (name, default, identity), x, y in zip(_OUTPUT_FIELDS, msgspec.structs.astuple(a), msgspec.structs.astuple(b)):
        if identity:
            values[name] = x
        elif type(x) is type(y) and isinstance(x, _CONCATENATED):
            values[name] = x + y
        elif x == y or y == default:
            values[name] = x
        elif x == default:
            values[name] = y
        else:
            return None
    return Output(**values)


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
    """A stage is alive; `loop_age_s` is how long its loop has been in one iteration (a stuck loop
    is restarted) and `in_flight` what it still holds (the supervisor drains until it is 0)."""

    stage: str
    replica: int = 0
    pid: int = 0
    loop_age_s: float = 0.0
    in_flight: int = 0


class Fatal(Message, tag="fatal"):
    """A stage cannot run (e.g. the model does not load); the supervisor stops with this message."""

    stage: str
    replica: int = 0
    pid: int = 0
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

REPLIES = (TokenizeReply, DetokenizeReply, ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList,
           StatsReply, WeightsUpdated, PrefixCacheReset)
AnyReply = Union[TokenizeReply, DetokenizeReply, ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList,
                 StatsReply, WeightsUpdated, PrefixCacheReset]

TokenizerInbound = Union[TextSubmit, Tokenize, Detokenize, GetStats]
EngineInbound = Union[Submit, Score, Abort, Pause, Resume, GetStats, AdapterPublish, AdapterUnload, ListAdapters,
                      WeightsUpdate, ResetPrefixCache, ReplicaStats]
DetokInbound = Union[Track, StepOutputs, RequestError, AnyReply]
ClientInbound = Union[Outputs, RequestError, Welcome, AnyReply]
RouterInbound = Union[Hello, GetStats]  # a client may ask the detokenizer for its stats
SupervisorInbound = Union[Ready, Heartbeat, Fatal]
ControlMessage = Union[StageDown, StageUp, Drain, Shutdown]
AnyMessage = Union[TextSubmit, Tokenize, Detokenize, GetStats, Submit, Score, Abort, Pause, Resume, AdapterPublish,
                   AdapterUnload, ListAdapters, Track, StepOutputs, RequestError, TokenizeReply, DetokenizeReply,
                   ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList, StatsReply, Hello, Welcome,
                   Outputs, Rollout, TrainingStatus, Ready, Heartbeat, Fatal, StageDown, StageUp, Drain, Shutdown,
                   WeightsUpdate, WeightsUpdated, ResetPrefixCache, PrefixCacheReset, ReplicaStats]


class ProtocolError(ValueError):
    """A frame that is not a valid message for the socket it arrived on. `reply` is the error to send
    back when the frame names who sent it (a `reply_to` and a `rid` or `qid`), else None."""

    def __init__(self, message: str, reply: "RequestError | None" = None) -> None:
        super().__init__(message)
        self.reply = reply


class _Sender(Struct):
    """Who a rejected frame came from, read leniently (unknown fields ignored)."""

    rid: str = ""
    qid: str = ""
    reply_to: bytes = b""


_sender_decoder = msgspec.msgpack.Decoder(_Sender)


def rejection(data: bytes, why: str) -> RequestError | None:
    """The 400 answer to a rejected frame, addressed to its sender; None when it names none."""
    try:
        sender = _sender_decoder.decode(data)
    except Exception:  # noqa: BLE001 - not even a map of the right field types: nobody to answer
        return None
    rid = sender.qid or sender.rid
    if not rid or not sender.reply_to:
        return None
    return RequestError(rid=rid, reply_to=sender.reply_to, status=400, code="invalid_message",
                        message=f"the message was rejected: {why}")


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
        except msgspec.ValidationError as exc:
            raise ProtocolError(str(exc), rejection(data, str(exc))) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bad UTF-8 in a str is not a DecodeError
            raise ProtocolError(str(exc)) from None
        except RecursionError:
            raise ProtocolError("the frame nests maps or arrays too deeply") from None
        if message.v != PROTOCOL_VERSION:
            why = f"protocol version {message.v} is not supported (this server speaks {PROTOCOL_VERSION})"
            raise ProtocolError(why, rejection(data, why))
        return message


def decode(data: bytes, accepted: Any = AnyMessage) -> Any:
    return Decoder(accepted).decode(data)
