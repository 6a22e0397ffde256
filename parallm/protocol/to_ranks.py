"""What a tensor-parallel group's ranks exchange (parallm/engine/distributed.py): rank 0 sends the
engine calls that change state since its last step as one numbered RankBatch, every other rank
replays them and acknowledges with RankAck; a rank on another machine is started with RankStart on
its stdin (launch/remote_rank.py). Each engine call is its own struct, so a reader sees every
operation the ranks agree on and a follower replays by type, never by a method's name.

Every call carries `now`, rank 0's scheduler clock when it was made (priority aging must read the
same clock on every rank)."""

from __future__ import annotations

from typing import Any, Union

from .base import FinishReason, Message, RequestSpec

__all__ = ["RankCall", "AddRequest", "AbortRequest", "AddScore", "LoadAdapter", "UnloadAdapter", "SetDefaultAdapter",
           "FollowLatest", "DropCachedBlocks", "UpdateWeights", "Step", "Flush", "StopFollowing", "RankCallKind",
           "RankBatch", "RankAck", "RankStart"]


class RankCall(Message, kw_only=True):
    now: float = 0.0


class AddRequest(RankCall, tag="rank_add_request"):
    rid: str
    prompt_ids: list[int]
    spec: RequestSpec


class AbortRequest(RankCall, tag="rank_abort"):
    rid: str
    reason: FinishReason = "abort"
    index: int | None = None


class AddScore(RankCall, tag="rank_add_score"):
    qid: str
    ids: list[int]
    start: int = 1
    top_logprobs: int = 0
    adapter: str = ""
    adapter_version: int = 0


class LoadAdapter(RankCall, tag="rank_load_adapter"):
    """The adapter's safetensors bytes, or a path every rank's machine has; each rank slices it for its
    shard (parallm/adapters/sharded.py)."""

    name: str
    config: dict[str, Any] | None = None
    weights: bytes | None = None
    path: str = ""
    format: str = "auto"
    version: int = 0


class UnloadAdapter(RankCall, tag="rank_unload_adapter"):
    name: str


class SetDefaultAdapter(RankCall, tag="rank_set_default_adapter"):
    name: str


class FollowLatest(RankCall, tag="rank_follow_latest"):
    pass


class DropCachedBlocks(RankCall, tag="rank_drop_cached_blocks"):
    pass


class UpdateWeights(RankCall, tag="rank_update_weights"):
    """New base weights: a directory every rank's machine has, or the tensors as safetensors bytes."""

    path: str = ""
    weights: bytes = b""
    version: int = 0
    complete: bool = True


class Step(RankCall, tag="rank_step"):
    """`prefill_rate` and `prefill_fixed_s`: rank 0's learned seconds per unit of prefill work and
    seconds per pass (engine/pacing.py: a and f) when it sent the step. Each rank times its own passes,
    so a follower pacing by its own model would size a different prefill budget and admit differently;
    every rank steps with rank 0's."""

    prefill_rate: float = 0.0
    prefill_fixed_s: float = 0.0


class Flush(RankCall, tag="rank_flush"):
    pass


class StopFollowing(RankCall, tag="rank_stop"):
    """The engine stage is shutting down: followers return."""


RankCallKind = Union[AddRequest, AbortRequest, AddScore, LoadAdapter, UnloadAdapter, SetDefaultAdapter, FollowLatest,
                     DropCachedBlocks, UpdateWeights, Step, Flush, StopFollowing]


class RankBatch(Message, tag="rank_batch"):
    """What rank 0 sends before a step: the calls since the last batch (the step last), the digest of
    its state after the previous step, and its number (1, 2, ...: a follower that sees a gap exits).
    What a follower's call SUB socket accepts."""

    calls: list[RankCallKind]
    digest: int
    seq: int = 0


class RankAck(Message, tag="rank_ack"):
    """A follower's state digest after replaying batch `seq`, and where its steps' time went so far
    (mean ms per step by phase, parallm/engine/rank_timing.py); what rank 0's ack PULL socket accepts."""

    rank: int
    seq: int
    digest: int
    step_ms_mean: dict[str, float] = {}
    collective_us: dict[str, float] = {}


class RankStart(Message, tag="rank_start"):
    """What a rank on another machine reads on stdin before the encoded configuration: its replica, the
    launcher's environment for it (MLX's and NCCL's variables) and files to write there, by the
    environment variable that names each (MLX's ring hostfile)."""

    replica: int = 0
    env: dict[str, str] = {}
    files: dict[str, str] = {}
