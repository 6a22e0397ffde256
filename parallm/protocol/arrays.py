"""Packed arrays: token ids as little-endian int32 bytes, floats as little-endian float32 bytes,
top-k alternatives flattened row-major; and the policy-version spans of a sample."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["pack_ids", "unpack_ids", "pack_floats", "unpack_floats", "count_ids", "TopRow", "pack_top",
           "unpack_top", "VersionSpans", "extend_spans", "version_at"]


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
