"""The messages an engine replica receives: tokenized requests, scoring, aborts, pauses, adapter and
full-weight updates, and replica i > 0's stats and answers for replica 0."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from .base import FinishReason, Message, RequestSpec
from .stats import EngineStats
from .tensors import Tensor
from .to_tokenizer import GetStats

__all__ = ["Submit", "Score", "Abort", "Pause", "Resume", "AdapterPublish", "WeightsUpdate", "ResetPrefixCache",
           "AdapterUnload", "ListAdapters", "ReplicaStats", "ReplicaAnswer", "TrainingPhase",
           "EngineInbound"]


class Submit(Message, tag="submit"):
    """A tokenized request. Raw ZeroMQ clients send this straight to the engine. `images`: a vision-language
    model's pixel values, one tensor per image in prompt order, as its processor made them; the prompt
    holds one run of the model's image token per image, where the engine puts the image's features."""

    rid: str
    reply_to: bytes
    prompt_ids: bytes
    spec: RequestSpec = msgspec.field(default_factory=RequestSpec)
    images: list[Tensor] = []


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


class ReplicaStats(Message, tag="replica_stats"):
    """Engine replica i > 0's stats, pushed to replica 0 about every second (parallm/routing.py), which
    answers GetStats with them in EngineStats.replicas."""

    replica: int
    stats: EngineStats
    pid: int = 0  # its process (a remote replica's liveness and restarts reach the supervisor through replica 0)


class ReplicaAnswer(Message, tag="replica_answer"):
    """Engine replica i > 0's answer to a control message replica 0 handed on to it (an adapter version, an
    unload, a pause, a weights update: stages/engine_fanout.py). Replica 0 answers the client once every
    replica has; `status` >= 400 with `code` and `message`: the replica refused it."""

    replica: int
    qid: str
    status: int = 200
    code: str = ""
    message: str = ""


class TrainingPhase(Message, tag="training_phase"):
    """A trainer's update began (`updating`, renewed after every micro-batch) or ended, sent on its PUB
    socket: while one runs, the engine leaves `engine.training_share` of the device to it
    (engine/device_share.py). The phase lapses `lease_s` seconds after the last message."""

    trainer: str
    updating: bool
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0


EngineInbound = Union[Submit, Score, Abort, Pause, Resume, GetStats, AdapterPublish, AdapterUnload, ListAdapters,
                      WeightsUpdate, ResetPrefixCache, ReplicaStats, ReplicaAnswer, TrainingPhase]
"""What an engine replica's PULL socket (and its adapters SUB socket) accepts."""
