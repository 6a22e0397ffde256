"""The messages a tokenizer receives: requests in text, and tokenize / detokenize / stats queries."""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .base import Message, RequestSpec

__all__ = ["TextSubmit", "Tokenize", "Detokenize", "GetStats", "TokenizerInbound"]


class TextSubmit(Message, tag="text_submit"):
    """A request in text (prompt or chat messages) or token ids, before tokenization. `images`: image URLs
    (data: or http(s)) of a prompt or prompt_ids request, in the order of the model's image token in it
    (chat messages carry theirs as image_url parts); the tokenizer fetches and processes them."""

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
    images: list[str] = []


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


TokenizerInbound = Union[TextSubmit, Tokenize, Detokenize, GetStats]
"""What a tokenizer's PULL socket accepts."""
