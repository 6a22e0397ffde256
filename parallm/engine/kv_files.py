"""One prefix-cache block on disk: the file format of the disk tier (disk_tier.py).

A block file holds the KV of `block_size` tokens for every layer (K then V), as raw bytes, after a
small msgpack header that names what it is: the tier's fingerprint (model, dtype, KV layout), the
block's chained hash, its token ids (a hit checks them, as the pool does, against hash collisions)
and each array's shape. A CRC-32 of header and payload ends the file, so a torn write (a process
killed mid-write, a disk that lost the tail) or flipped bytes are found before anything is served.

Writes are atomic: the bytes go to a temporary name in the same directory, then `os.replace`
renames it, so a reader sees a whole file or none. No fsync: a killed process loses nothing the
kernel has; after a machine crash a renamed file whose data did not reach the disk fails its
checksum and is dropped like any corrupt one.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import msgspec
import numpy as np

MAGIC = b"PLLMKV01"
TMP_SUFFIX = ".tmp"
SUFFIX = ".kv"
_LEN = struct.Struct("<I")


class BlockHeader(msgspec.Struct, frozen=True, array_like=True):
    fingerprint: str
    block_hash: int
    token_ids: list[int]
    dtype: str                      # the KV's dtype (an mx.Dtype's name; quantized: plus /q<bits>g<group size>)
    shapes: list[tuple[int, ...]]   # per stored array (K of each layer, then V): [heads, block_size, width]


class CorruptBlock(ValueError):
    """A block file that must not be served: torn, corrupted, or not the block asked for."""


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(BlockHeader)


def encode_block(header: BlockHeader, arrays: list[bytes]) -> bytes:
    """The file's bytes: MAGIC, header length, header, payload (the arrays' bytes in order), CRC-32."""
    head = _header_encoder.encode(header)
    body = b"".join([MAGIC, _LEN.pack(len(head)), head, *arrays])
    return body + _LEN.pack(zlib.crc32(body))


def decode_block(data: bytes, fingerprint: str, block_hash: int, token_ids: tuple[int, ...] | None = None,
                 itemsize: int | list[int] | None = None) -> tuple[BlockHeader, list[np.ndarray]]:
    """The header and the per-array uint8 views of a block file's bytes; CorruptBlock if the file is
    torn or corrupt, or is another block (fingerprint, hash or, when given, tokens differ). `itemsize`:
    the arrays' element size, one for all or one per array (quantized K/V mix uint32 and float parts)."""
    if len(data) < len(MAGIC) + 2 * _LEN.size or data[:len(MAGIC)] != MAGIC:
        raise CorruptBlock("not a block file (bad magic or too short)")
    body, (crc,) = data[:-_LEN.size], _LEN.unpack(data[-_LEN.size:])
    if zlib.crc32(body) != crc:
        raise CorruptBlock("checksum mismatch")
    (head_len,) = _LEN.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = _header_decoder.decode(body[start:start + head_len])
    except msgspec.DecodeError as exc:
        raise CorruptBlock(f"bad header: {exc}") from None
    if header.fingerprint != fingerprint or header.block_hash != block_hash:
        raise CorruptBlock("another block (fingerprint or hash differs)")
    if token_ids is not None and tuple(header.token_ids) != tuple(token_ids):
        raise CorruptBlock("another block (token ids differ)")
    payload = memoryview(body)[start + head_len:]
    sizes_of = itemsize if isinstance(itemsize, list) else [itemsize or 1] * len(header.shapes)
    if len(sizes_of) != len(header.shapes):
        raise CorruptBlock(f"the file holds {len(header.shapes)} arrays, the tier's format {len(sizes_of)}")
    sizes = [int(np.prod(shape)) * size for shape, size in zip(header.shapes, sizes_of)]
    if itemsize is not None and sum(sizes) != len(payload):
        raise CorruptBlock(f"payload is {len(payload)} bytes, the shapes want {sum(sizes)}")
    out, at = [], 0
    for n in sizes:
        out.append(np.frombuffer(payload[at:at + n], dtype=np.uint8))
        at += n
    return header, out


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a temporary file in the same directory, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
