"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, the classification
routes (/v1/classifications and vLLM's /classify), the reward routes (/v1/rewards and vLLM's /pooling)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from msgspec import Meta, Struct

from parallm.api.schemas import INT32, PRIORITY_DOC, ChatMessage, TokenId

# a string, strings, token ids, or lists of token ids (OpenAI's `input`); msgspec takes one array type in a
# union, so the list's items are checked to be all of one kind by the route (pooling.inputs)
Input = Union[str, Annotated[list[Union[str, TokenId, list[TokenId]]], Meta(min_length=1)]]
# one conversation (messages), or a list of conversations: the route checks it is all one or the other
Conversations = Annotated[list[Union[ChatMessage, Annotated[list[ChatMessage], Meta(min_length=1)]]],
                          Meta(min_length=1)]


class EmbeddingRequest(Struct, kw_only=True):
    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, lt=INT32)] | None = None  # Matryoshka models only (400 otherwise)
    user: str | None = None
    priority: Annotated[int, Meta(ge=-INT32, lt=INT32, description=PRIORITY_DOC)] = 0


class Embedding(Struct, kw_only=True):
    index: int
    embedding: list[float] | str       # str: base64 of little-endian float32
    object: str = "embedding"


class PoolingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: PoolingUsage
    object: str = "list"


class ClassificationRequest(Struct, kw_only=True):
    input: Input
    model: str | None = None
    user: str | None = None
    priority: Annotated[int, Meta(ge=-INT32, lt=INT32, description=PRIORITY_DOC)] = 0


class ClassificationData(Struct, kw_only=True):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: str = "list"


class RewardRequest(Struct, kw_only=True):
    """Exactly one of `input` (text or token ids) or `messages` (one conversation, or a list of them,
    templated with the reward model's own chat template)."""

    input: Input | None = None
    messages: Conversations | None = None
    model: str | None = None
    user: str | None = None
    priority: Annotated[int, Meta(ge=-INT32, lt=INT32, description=PRIORITY_DOC)] = 0


class Reward(Struct, kw_only=True):
    index: int
    reward: float
    object: str = "reward"


class RewardResponse(Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[Reward]
    usage: PoolingUsage
    object: str = "list"


class PoolingRequest(Struct, kw_only=True):
    """vLLM's /pooling: `task` picks what the model gives (reward: one scalar per input)."""

    input: Input | None = None
    messages: Conversations | None = None
    model: str | None = None
    task: Literal["embed", "reward", "classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, lt=INT32)] | None = None
    user: str | None = None
    priority: Annotated[int, Meta(ge=-INT32, lt=INT32, description=PRIORITY_DOC)] = 0


class PoolingData(Struct, kw_only=True):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingResponse(Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"
