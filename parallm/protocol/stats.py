"""What each stage reports about itself (GetStats, ingress' /metrics): plain values only, so the wire
schema depends on no other module of parallm (the engine's settings travel as a map of values)."""

from __future__ import annotations

from typing import Any, Union

import msgspec
from msgspec import Struct

__all__ = ["AdapterStats", "RankState", "WeightsStatus", "LoopStats", "BlasStats", "StepRecord", "BurstStats",
           "KVDiskStats", "SpecStats", "EngineStats", "TokenizerStats", "DetokenizerStats", "PolicyStats", "StageStats"]


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
    # where this rank's steps went, mean ms per engine step by phase (parallm/engine/rank_timing.py): the
    # engine's (schedule, prefill, mixed, launch, read), rank 0's plan, a follower's wait, replay and ack
    step_ms_mean: dict[str, float] = {}
    # all-sums over the group measured alone at start, in microseconds (rank_timing.probe_collectives)
    collective_us: dict[str, float] = {}


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
    kind: str = ""                # decode, prefill, prefill+decode, mixed, prefill+mixed, read
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
    ops: dict[str, int] = {}      # row operations run, by kind (Resize, CopyRow, CopyBlocks, ...)


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


class KVDiskStats(Struct, kw_only=True):
    """The prefix cache's disk tier (kv.disk_dir): counters since the engine started, and its size now."""

    dir: str = ""
    policy: str = ""
    files: int = 0
    bytes: int = 0
    hits: int = 0             # blocks read back instead of recomputed
    misses: int = 0           # blocks looked up and not found (or unreadable)
    read_bytes: int = 0
    written: int = 0
    written_bytes: int = 0
    dropped: int = 0          # blocks not written: the writer's queue was full
    corrupt_files: int = 0    # torn or corrupt files found, deleted and never served
    expired: int = 0
    evicted: int = 0
    errors: int = 0
    queue_depth: int = 0


class SpecStats(Struct, kw_only=True):
    """Speculative decoding since the engine started (spec.mode; engine/spec/control.py)."""

    mode: str = "none"
    verify_passes: int = 0          # target passes that verified proposals
    rows_verified: int = 0          # (row, pass) pairs with a proposal
    proposed_tokens: int = 0
    accepted_tokens: int = 0        # proposed tokens equal to the target's own sample
    emitted_tokens: int = 0         # tokens the speculating rows emitted (accepted + one per row and pass)
    acceptance_rate: float = 0.0    # accepted_tokens / proposed_tokens
    mean_accepted_tokens: float = 0.0  # accepted_tokens / rows_verified
    k_distribution: dict[str, int] = {}  # proposal length -> rows verified with it
    steps_off_batch: int = 0        # steps not speculating: more running rows than spec.disable_batch_size


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
    prefix_partial_hits: int = 0  # admissions that started from a copy of a partly matching cached block
    prefix_evictions: int = 0
    preemptions: int = 0
    priority_preemptions: int = 0       # of those, made room for a request of better priority
    admissions_delayed: int = 0         # steps that admitted nothing to fill a fuller pass (engine.admit_delay_factor)
    steps: int = 0
    mixed_passes: int = 0
    decode_batch_hist: dict[int, int] = {}
    max_decode_batch: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    scored_tokens: int = 0
    pooled_requests: int = 0      # pooling requests answered (RequestSpec.pooling)
    pooled_tokens: int = 0        # their prompt tokens
    pooling_batches: int = 0      # the batched passes that computed them
    pooling_waiting: int = 0
    step_ms_mean: dict[str, float] = {}
    live_rows: int = 0
    live_capacity: int = 0
    live_bytes: int = 0           # the KV block store's arrays (and per-row state) allocated now
    pool_bytes: int = 0           # the store's cached blocks (no live reference)
    bytes_per_token: int = 0
    penalty_state: bool = False
    compiled_decode: dict[str, int] = {}  # engine.compiled_decode: passes run compiled, traces, eager_<reason> fallbacks
    adapters: AdapterStats = msgspec.field(default_factory=AdapterStats)
    settings: dict[str, Any] | None = None  # the engine settings ([engine], every unset one resolved), by name
    adapter_settings: dict[str, Any] | None = None  # the [adapters] settings, by name
    weight_dtype: dict[str, str] | None = None  # stored, served (the weights' dtype) and reason (models/dtype.py)
    weights_version: int = 0      # the base model's policy version (full-weight updates applied)
    weights_updates: int = 0
    recomputed_tokens: int = 0    # computed tokens preemptions threw away (recomputed when readmitted)
    oom_retries: int = 0          # allocations retried after freeing MLX's buffer cache (engine/memory.py)
    kv_copied_bytes: dict[str, int] = {}  # bytes the row ops copied since start, by kind: "cow" (an n > 1
                                          # fork's partly filled last block: the only KV copy), "state" (per-row state)
    kv_capacity_tokens: int = 0   # tokens the KV budget holds (live rows and prefix cache) at the KV dtype and bits
    kv_live_tokens: int = 0       # tokens running and prefilling sequences hold
    kv_waiting_tokens: int = 0    # tokens waiting sequences need
    kv_utilization: float = 0.0   # kv_live_tokens / live_token_slots
    kv_demand: float = 0.0        # (kv_live_tokens + kv_waiting_tokens) / live_token_slots
    kv_pressure: str = "ok"       # ok, degraded or overloaded against kv.pressure_threshold (engine/pressure.py)
    kv_pressure_rejections: int = 0  # requests refused with 503 kv_pressure
    kv_disk: KVDiskStats | None = None  # the disk tier, when kv.disk_dir is set
    spec: SpecStats | None = None  # speculative decoding, when spec.mode is not none
    burst: BurstStats | None = None       # the steps of the work in progress (engine/trace.py)
    last_burst: BurstStats | None = None  # the last burst of steps that ended with nothing left to do
    # the engine stage's own
    weights: WeightsStatus = msgspec.field(default_factory=WeightsStatus)
    paused: bool = False
    integrity_checks: int = 0     # engine.check_integrity() runs when the engine went idle (the stage's loop)
    integrity_failures: int = 0   # of those, failed (logged)
    held_for_version: int = 0
    received: int = 0
    dropped_frames: int = 0
    training_share: float = 0.0   # engine.training_share: the device's share left to a trainer's update
    training_phases: int = 0      # trainers' update phases the engine heard begin (TrainingPhase)
    training_updating: bool = False  # a trainer's update runs now
    training_rest_s: float = 0.0  # seconds the engine rested to leave them the device
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
    affinity_hits: int = 0  # of those, sent to the replica this tokenizer placed their prefix on
    home_hits: int = 0      # of those, sent to their prefix anchor's home replica (parallm/routing.py)
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


class PolicyStats(Struct, tag="policy", kw_only=True):
    requests: int = 0          # act and predict requests answered (errors included)
    rejected: int = 0          # of those, refused (unknown model, bad tensor, a full queue)
    failed: int = 0            # of those, failed in the forward (500)
    batches: int = 0
    rows: int = 0              # rows run through forwards
    max_batch_rows: int = 0
    episodes: int = 0          # episodes whose state the server keeps
    episodes_expired: int = 0
    weights_updates: int = 0
    weights_rejected: int = 0
    versions: dict[str, int] = {}
    dropped_frames: int = 0


StageStats = Union[EngineStats, TokenizerStats, DetokenizerStats, PolicyStats]
