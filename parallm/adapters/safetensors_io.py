"""safetensors to and from bytes, without touching the filesystem (inline adapter publishes).

The format is an 8-byte little-endian header length, a JSON header mapping tensor names to
{dtype, shape, data_offsets}, then the raw little-endian data. bfloat16 travels as its raw
16-bit pattern (numpy has no bfloat16) and is reinterpreted by MLX.

Reading makes one MLX array per dtype and gives each tensor a view of it (a slice of a
contiguous buffer shares it), and checks finiteness on the host first: on a GPU every MLX
array is an allocation and every op a kernel launch, so a load costs O(1) of each rather than
O(tensors).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Callable, Mapping

import mlx.core as mx
import numpy as np

from .errors import AdapterError

_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
       "I32": np.int32, "I64": np.int64, "I8": np.int8, "U8": np.uint8, "I16": np.int16, "BOOL": np.bool_}
_CODE = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int32: "I32", mx.int64: "I64",
         mx.int8: "I8", mx.uint8: "U8", mx.int16: "I16", mx.bool_: "BOOL"}
_ITEMSIZE = {code: np.dtype(t).itemsize for code, t in _NP.items()}
_FLOATS = ("F32", "F16", "BF16", "F64")
# 16-bit floats are non-finite iff their exponent bits are all ones: |bits| >= the bits of inf
_INF_BITS = {"F16": 0x7C00, "BF16": 0x7F80}

Target = Callable[[str], "mx.Dtype | None"]


@dataclass(frozen=True, slots=True)
class _Spec:
    name: str
    code: str
    shape: tuple[int, ...]
    start: int
    end: int
    size: int


def load_bytes(data: bytes) -> dict[str, mx.array]:
    """Tensors of a safetensors blob; AdapterError when it is not one."""
    return read_bytes(data)[0]


def read_bytes(data: bytes, target: Target | None = None) -> tuple[dict[str, mx.array], list[str]]:
    """(tensors, names of those holding NaN or inf in header order) of a safetensors blob.

    `target(name)` is the dtype a float tensor is wanted in (None: as stored); tensors are cast
    per group sharing a stored and a wanted dtype, one cast for each. float64 is read as float32,
    as MLX reads it, and checked after that conversion.
    """
    specs, body = _specs(data)
    groups: dict[tuple[str, mx.Dtype | None], list[_Spec]] = {}
    for s in specs:
        want = target(s.name) if target is not None and s.code in _FLOATS else None
        groups.setdefault((s.code, want), []).append(s)
    out: dict[str, mx.array] = {}
    bad: set[str] = set()
    for (code, want), group in groups.items():
        group.sort(key=lambda s: s.start)
        host = _host_array(body, code, group)
        bad.update(_nonfinite_host(host, code, group))
        out.update(_views(_device_array(host, code, want), group))
    mx.eval(list(out.values()))
    return {s.name: out[s.name] for s in specs}, [s.name for s in specs if s.name in bad]


def save_bytes(tensors: Mapping[str, mx.array], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors blob holding `tensors` (as mx.save_safetensors writes, in memory)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    chunks, offset = [], 0
    for name in sorted(tensors):
        a = tensors[name]
        if a.dtype not in _CODE:
            raise AdapterError(f"tensor {name!r} has dtype {a.dtype}, which safetensors cannot hold here")
        raw = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()
        header[name] = {"dtype": _CODE[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def _specs(data: bytes) -> tuple[list[_Spec], memoryview]:
    if len(data) < 8:
        raise AdapterError("weights are not safetensors: fewer than 8 bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise AdapterError(f"weights are not safetensors: header length {n} exceeds the {len(data)} bytes given")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as exc:
        raise AdapterError(f"weights are not safetensors: header is not JSON ({exc})") from None
    body = memoryview(data)[8 + n:]
    specs = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        code = spec.get("dtype")
        if code not in _NP:
            raise AdapterError(f"tensor {name!r} has dtype {code!r}, which parallm does not read")
        start, end = spec["data_offsets"]
        shape = tuple(spec["shape"])
        if not 0 <= start <= end <= len(body):
            raise AdapterError(f"tensor {name!r}: data offsets {start}..{end} outside the {len(body)} data bytes")
        size, rest = divmod(end - start, _ITEMSIZE[code])
        if rest:
            raise AdapterError(f"tensor {name!r}: {end - start} data bytes are not a whole number of {code} values")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise AdapterError(f"tensor {name!r}: shape {shape} is not a list of non-negative integers")
        if size != math.prod(shape):
            raise AdapterError(f"tensor {name!r}: {size} values do not fill shape {shape}")
        specs.append(_Spec(name, code, shape, start, end, size))
    return specs, body


def _host_array(body: memoryview, code: str, group: list[_Spec]) -> np.ndarray:
    """The group's values end to end, in group order: the blob itself where they lie so in it."""
    if all(a.end == b.start for a, b in zip(group, group[1:])):
        raw = body[group[0].start:group[-1].end]
    else:
        raw = b"".join(body[s.start:s.end] for s in group)
    flat = np.frombuffer(raw, dtype=_NP[code])
    if code != "F64":
        return flat
    with np.errstate(over="ignore"):
        return flat.astype(np.float32)


def _nonfinite_host(host: np.ndarray, code: str, group: list[_Spec]) -> list[str]:
    if code not in _FLOATS:
        return []
    if code in _INF_BITS:
        inf = _INF_BITS[code]
        bits = host.view(np.uint16) & 0x7FFF
        if bits.size == 0 or bits.max() < inf:
            return []
        finite = bits < inf
    else:
        finite = np.isfinite(host)
        if finite.all():
            return []
    return [s.name for s, (lo, hi) in zip(group, _bounds(group)) if not finite[lo:hi].all()]


def _device_array(host: np.ndarray, code: str, want: mx.Dtype | None) -> mx.array:
    flat = mx.array(host)
    if code == "BF16":
        flat = flat.view(mx.bfloat16)
    return flat if want is None else flat.astype(want)


def _views(flat: mx.array, group: list[_Spec]) -> dict[str, mx.array]:
    return {s.name: flat[lo:hi].reshape(s.shape) for s, (lo, hi) in zip(group, _bounds(group))}


def _bounds(group: list[_Spec]) -> list[tuple[int, int]]:
    out, at = [], 0
    for s in group:
        out.append((at, at + s.size))
        at += s.size
    return out
