"""What the engine stage sends back for the engine's outputs: a step's token deltas (packed), a score's
reply and a refusal's RequestError (stages/engine.py sends them)."""

from __future__ import annotations

import struct

from parallm import protocol
from parallm.adapters import AdapterError
from parallm.engine import RequestRejected, ScoreResult, SeqOutput

_PACK_ONE_ID = struct.Struct("<i").pack


def pack_step_ids(ids: list[int]) -> bytes:
    """`protocol.pack_ids` for a step's few tokens (the same bytes) without numpy's per-call cost,
    which at batch 256 was most of the stage's send time (docs/performance.md)."""
    return _PACK_ONE_ID(ids[0]) if len(ids) == 1 else struct.pack(f"<{len(ids)}i", *ids)


def to_delta(out: SeqOutput) -> protocol.SeqDelta:
    delta = protocol.SeqDelta(rid=out.rid, index=out.index, token_ids=pack_step_ids(out.token_ids),
                              finish_reason=out.finish_reason, adapter=out.adapter, version=out.version,
                              usage=out.usage)
    if out.logprobs is not None:
        delta.logprobs = protocol.pack_floats(out.logprobs)
    if out.top_logprobs:
        delta.top_ids, delta.top_logprobs = protocol.pack_top(out.top_logprobs)
    if out.prompt_logprobs is not None:
        delta.prompt_logprobs = protocol.pack_floats([float("nan") if lp is None else lp
                                                      for lp in out.prompt_logprobs])
        if out.prompt_top_logprobs:
            delta.prompt_top_ids, delta.prompt_top_logprobs = protocol.pack_top(
                [row for row in out.prompt_top_logprobs if row])
        if out.prompt_ranks:
            delta.prompt_ranks = protocol.pack_ids([rank or 0 for rank in out.prompt_ranks])
    return delta


def score_reply(result: ScoreResult, reply_to: bytes) -> protocol.ScoreReply | protocol.RequestError:
    if result.aborted:
        return protocol.RequestError(rid=result.qid, reply_to=reply_to, status=409, code="aborted",
                                     message="the score request was aborted before it was done")
    reply = protocol.ScoreReply(qid=result.qid, reply_to=reply_to, logprobs=protocol.pack_floats(result.logprobs))
    if result.top_logprobs:
        reply.top_ids, reply.top_logprobs = protocol.pack_top(result.top_logprobs)
    return reply


def rejection(rid: str, reply_to: bytes, exc: RequestRejected | AdapterError) -> protocol.RequestError:
    """The error a refused request (or control request: `rid` is its qid) gets, with the engine's own
    status and OpenAI code (e.g. context_length_exceeded, adapter_not_found)."""
    return protocol.RequestError(rid=rid, reply_to=reply_to, status=exc.status, code=exc.code or "invalid_request_error",
                                 message=exc.message, param=getattr(exc, "param", None),
                                 retryable=getattr(exc, "retryable", False))
