"""Stored responses (`store: true`): what GET /v1/responses/{id}, previous_response_id and
input_items read, bounded in count and in bytes with the least recently used evicted first.

An entry holds the response object, the conversation that a continuing response starts from (the
chat messages of its input and output) and its input items. Its size is the length of those as
JSON, counted once when stored. A background response still running is never evicted (its task
holds a Gate slot and will store its end); the bounds may be passed by those alone.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from parallm.api.responses_schemas import ResponseObject
from parallm.api.schemas import ChatMessage

_encoder = msgspec.json.Encoder()


@dataclass
class Stored:
    response: ResponseObject
    messages: list[ChatMessage]            # input and output of the whole conversation up to this response
    input_items: list[dict[str, Any]]
    task: asyncio.Task[Any] | None = None  # a background response's generation, while it runs
    size: int = field(default=0)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def measure(self) -> None:
        self.size = len(_encoder.encode(self.response)) + len(_encoder.encode(self.messages)) + \
            len(_encoder.encode(self.input_items))


class ResponseStore:
    """An LRU map of response id -> Stored, at most `max_count` entries and `max_bytes` bytes."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, rid: str) -> Stored | None:
        entry = self.entries.get(rid)
        if entry is not None:
            self.entries.move_to_end(rid)
        return entry

    def put(self, rid: str, entry: Stored) -> None:
        """Store (or replace) an entry as the most recently used, then evict past the bounds."""
        self.remove(rid)
        entry.measure()
        if self.max_count <= 0 or (entry.size > self.max_bytes > 0 and not entry.running):
            return
        self.entries[rid] = entry
        self.bytes += entry.size
        self._evict()

    def remove(self, rid: str) -> Stored | None:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def _evict(self) -> None:
        for rid in list(self.entries):
            if len(self.entries) <= self.max_count and (self.max_bytes <= 0 or self.bytes <= self.max_bytes):
                return
            if not self.entries[rid].running:
                self.remove(rid)
                self.evicted += 1
