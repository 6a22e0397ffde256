"""safetensors to and from bytes, without touching the filesystem (inline adapter publishes).

The format is an 8-byte little-endian header length, a JSON header mapping tensor names to
{dtype, shape, data_offsets}, then the raw little-endian data. bfloat16 travels as its raw
16-bit pattern (numpy has no bfloat16) and is reinterpreted by MLX.
"""

from __future__ import annotations

import json
import struct
from typing import Mapping

import mlx.core as mx
import numpy as np

from .errors import AdapterError

_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
       "I32": np.int32, "I64": np.int64, "I8": np.int8, "U8": np.uint8, "I16": np.int16, "BOOL": np.bool_}
_CODE = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int32: "I32", mx.int64: "I64",
         mx.int8: "I8", mx.uint8: "U8", mx.int16: "I16", mx.bool_: "BOOL"}


def load_bytes(data: bytes) -> dict[str, mx.array]:
    """Tensors of a safetensors blob; AdapterError when it is not one."""
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
    out: dict[str, mx.array] = {}
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
        arr = np.frombuffer(body[start:end], dtype=_NP[code])
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise AdapterError(f"tensor {name!r}: {arr.size} values do not fill shape {shape}")
        a = mx.array(arr.reshape(shape))
        out[name] = a.view(mx.bfloat16) if code == "BF16" else a
    return out


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
