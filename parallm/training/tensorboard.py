"""The trainer's per-step metrics as TensorBoard event files, written directly (no dependency).

    DIR/events.out.tfevents.<time>.<host>.<pid>      `tensorboard --logdir DIR` reads it

An event file is TFRecord framing (length, masked CRC-32C of the length, the bytes, masked CRC-32C
of the bytes) around `Event` protobuf messages: the first holds `file_version = "brain.Event:2"`,
each later one a step's `Summary` of `simple_value` scalars, one per tag. The few protobuf fields
involved are encoded here by hand (tensorboard/compat/proto/event.proto and summary.proto:
Event{1: wall_time double, 2: step int64, 3: file_version string, 5: summary}, Summary{1: value},
Summary.Value{1: tag string, 2: simple_value float}); tests read the files back with TensorBoard's
own generated classes (tensorboardX.proto.event_pb2).
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import IO, Any, Mapping


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int = 0, *, file_version: str = "", summary: bytes = b"") -> bytes:
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version:
        out += _field_bytes(3, file_version.encode())
    if summary:
        out += _field_bytes(5, summary)
    return out


def _scalar(tag: str, value: float) -> bytes:
    return _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics record by tag (nested mappings as `outer/inner`); others left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{tag}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    return out


class EventWriter:
    """Appends steps of scalars to one new event file under `logdir` (created if missing)."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        root = Path(logdir)
        root.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = root / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._file: IO[bytes] = self.path.open("ab")
        self._write(_event(now, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(header + _masked(header) + data + _masked(data))
        self._file.flush()

    def add_scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        summary = b"".join(_scalar(tag, value) for tag, value in values.items())
        self._write(_event(time.time() if wall_time is None else wall_time, step, summary=summary))

    def close(self) -> None:
        self._file.close()
