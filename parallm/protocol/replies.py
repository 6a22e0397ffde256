"""A stage's answers to control requests, routed by the detokenizer to the asker's `reply_to`."""

from __future__ import annotations

from typing import Any, Literal, Union

from msgspec import Struct

from .base import Message
from .stats import StageStats
from .to_policy import Tensor

__all__ = ["Reply", "TokenizeReply", "DetokenizeReply", "ScoreReply", "PauseState", "AdapterVersion", "AdapterInfo",
           "AdapterLoaded", "AdapterUnloaded", "WeightsUpdated", "PrefixCacheReset", "AdapterList", "StatsReply",
           "REPLIES", "AnyReply", "PolicyActReply", "PredictReply", "PolicyInfo", "PolicyList"]


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


class StatsReply(Reply, tag="stats_reply"):
    stats: StageStats


class PolicyActReply(Reply, tag="policy_act_reply"):
    """The policy stage's answer to PolicyAct, on its ROUTER (not routed by the detokenizer)."""

    actions: Tensor                      # int64 [B] (categorical) or float32 [B, dim] (gaussian)
    action_log_probs: Tensor             # float32 [B]
    value_estimates: Tensor | None = None  # float32 [B] when the policy has a value head
    new_hidden_states: dict[str, Tensor] = {}
    version: int = 0                     # the weights that acted


class PredictReply(Reply, tag="predict_reply"):
    outputs: dict[str, Tensor]
    new_hidden_states: dict[str, Tensor] = {}
    version: int = 0


class PolicyInfo(Struct, kw_only=True):
    name: str
    version: int
    action: str = ""                     # "categorical", "gaussian", or "" (predict only)
    value: bool = False
    signature: dict[str, Any] = {}       # {"inputs"|"state"|"outputs": {name: {"shape": [null, ...], "dtype"}}}


class PolicyList(Reply, tag="policy_list"):
    policies: list[PolicyInfo]


REPLIES = (TokenizeReply, DetokenizeReply, ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList,
           StatsReply, WeightsUpdated, PrefixCacheReset)
AnyReply = Union[TokenizeReply, DetokenizeReply, ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList,
                 StatsReply, WeightsUpdated, PrefixCacheReset]
