"""What the policy stage receives: act, predict and listing requests on its ROUTER (answered there, to the
DEALER that asked), and trainers' full-weight updates on its bound SUB (docs/policies.md)."""

from __future__ import annotations

from typing import Union

from msgspec import Struct

from .base import Message
from .to_tokenizer import GetStats

__all__ = ["Tensor", "PolicyAct", "Predict", "ListPolicies", "PolicyWeights", "PolicyInbound",
           "PolicyWeightsInbound"]


class Tensor(Struct, kw_only=True, forbid_unknown_fields=True):
    """A tensor on the wire: `data` is packed little-endian bytes, row-major, of `dtype` (float32,
    float16, float64, int32, int64, int8, uint8, bool) and `shape` (the batch dimension first)."""

    dtype: str
    shape: list[int]
    data: bytes


class PolicyInputs(Message, kw_only=True):
    """What a policy request carries (the base of PolicyAct and Predict): named input tensors for the
    policy `model`, and recurrent state from `hidden_states` (given whole by the client), or kept by the
    server per row's `episode_ids` (a row whose `episode_starts` is true starts again from zeros), else
    zeros."""

    qid: str
    model: str
    inputs: dict[str, Tensor]
    hidden_states: dict[str, Tensor] = {}
    episode_ids: list[str] = []
    episode_starts: list[bool] = []


class PolicyAct(PolicyInputs, tag="policy_act"):
    """Actions for a batch of observations (`/v1/rl/act`), sent on the policy stage's ROUTER by a DEALER
    and answered there by PolicyActReply (or RequestError, `rid` = qid, `param` the bad tensor).
    Row i of a request with `seed` draws from seed + i (docs/protocol.md); `deterministic`: the mode."""

    deterministic: bool = False
    seed: int | None = None


class Predict(PolicyInputs, tag="predict"):
    """Named tensors in, the network's named outputs out (`/v1/predict`); answered by PredictReply."""


class ListPolicies(Message, tag="list_policies"):
    """The served policies and their signatures; answered by PolicyList."""

    qid: str


class PolicyWeights(Message, tag="policy_weights"):
    """A served policy's full weights (safetensors bytes, every tensor), from a trainer's PUB to the
    policy stage's bound SUB (`policy_weights` address). `version` 0: the latest + 1; otherwise it must
    be larger than the latest. Applied between two batches; every later action carries the version."""

    model: str
    weights: bytes
    version: int = 0


PolicyInbound = Union[PolicyAct, Predict, ListPolicies, GetStats]
"""What the policy stage's ROUTER accepts."""
PolicyWeightsInbound = PolicyWeights
"""What the policy stage's SUB accepts."""
