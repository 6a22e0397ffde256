"""Prefix-block hashing, pure Python (no MLX): the keys of the engine's prefix cache.

A block's key is a chained hash of (parent block's key, the block's token ids, adapter identity), so a
block matches only after exactly the same prefix under the same adapter. The engine's BlockManager
(parallm/engine/blocks.py) keys its cache with these; the tokenizers' replica router
(parallm/routing.py) hashes prompts the same way without importing the engine.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Sequence

NO_HASH = -1  # the parent of a prompt's first block (and a block that holds no hash)


def block_hash(parent: int, tokens: Sequence[int], adapter: str = "") -> int:
    """Chained 63-bit hash of one block (stable across processes, unlike `hash()`)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", parent))
    h.update(array("i", tokens).tobytes())
    h.update(adapter.encode())
    return int.from_bytes(h.digest(), "little") >> 1


def block_hashes(ids: Sequence[int], block_size: int, adapter: str = "") -> list[int]:
    """The chained hashes of the prompt's full blocks, as the engine's prefix cache keys them."""
    out, parent = [], NO_HASH
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_hash(parent, ids[start:start + block_size], adapter)
        out.append(parent)
    return out
