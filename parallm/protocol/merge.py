"""Outputs of one sequence merged for a reader that fell behind."""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from .to_clients import Output

__all__ = ["coalesce_outputs"]


def coalesce_outputs(items: Sequence[Output]) -> list[Output]:
    """Consecutive outputs of one sequence merged into one, for a reader that fell behind (several
    steps' outputs waiting): variable-length fields (token ids, text, logprobs, per-token lists)
    concatenate; any other field is taken where only one side sets it; outputs that disagree on one
    (another sample, another policy version) or follow a finished one stay apart."""
    merged: list[Output] = []
    for item in items:
        last = merged[-1] if merged else None
        combined = _merged(last, item) if last is not None and last.finish_reason is None else None
        if combined is None:
            merged.append(item)
        else:
            merged[-1] = combined
    return merged


_OUTPUT_IDENTITY = ("rid", "index", "adapter", "version")  # equal in outputs that merge
# (name, default, is identity) of every Output field, in order (read once: fields() builds new objects)
_OUTPUT_FIELDS = tuple((f.name, f.default if f.default is not msgspec.NODEFAULT else None, f.name in _OUTPUT_IDENTITY)
                       for f in msgspec.structs.fields(Output))
_CONCATENATED = (bytes, str, list)


def _merged(a: Output, b: Output) -> Output | None:
    if a.rid != b.rid or a.index != b.index or a.adapter != b.adapter or a.version != b.version:
        return None
    values: dict[str, Any] = {}
    for (name, default, identity), x, y in zip(_OUTPUT_FIELDS, msgspec.structs.astuple(a), msgspec.structs.astuple(b)):
        if identity:
            values[name] = x
        elif type(x) is type(y) and isinstance(x, _CONCATENATED):
            values[name] = x + y
        elif x == y or y == default:
            values[name] = x
        elif x == default:
            values[name] = y
        else:
            return None
    return Output(**values)
