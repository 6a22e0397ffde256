"""The prefix cache's disk tier in the engine: what connects the block bookkeeping (blocks.py), the
block store (cache.LiveKV: the live sequences' and the prefix cache's KV alike) and the block files
(disk_tier.py).

BlockManager calls three hooks (its `tier`): `stored` when a block gets a key (the passes that wrote
its KV were launched before: a block is keyed once its last token is computed), `evicting` when a
cached block is about to be reused, and `fetch` when a prefix lookup misses in memory (a block read
back from disk is written into the store, one copy of its tiles, and installed as a cached block;
the lookup goes on). The runner calls `before_ops` and `after_ops` around every step's row ops,
before the step's passes are launched: the KV of blocks evicted since the last step is read before
any pass writes into them, and (write_through) blocks keyed since then are saved. No write-back
moves KV between stores: a block file's per-layer tiles [heads, block_size, width] are the store's
head-major tiles.

Which KV goes to disk: blocks of the base model at its load-time weights (adapter key ""), the
only ones whose key means the same after a restart: an adapter's name and version, and a
weight update's version, name other weights in another process.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Literal, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from parallm.config import KVConfig
from parallm.protocol import KVDiskStats

from .blocks import BlockManager, block_hash
from .cache import LayerShape, LiveKV
from .kv_format import KVFormat
from .disk_tier import DiskTier
from .kv_files import BlockHeader

log = logging.getLogger("parallm.engine")

Policy = Literal["evict_only", "write_through"]


def fingerprint(model_path: str, model: nn.Module, dtype: mx.Dtype, shapes: Sequence[LayerShape],
                block_size: int, kv_bits: int = 0, group_size: int = 0) -> str:
    """What a block file's KV depends on besides its tokens: the model (its path as configured, and
    every parameter's name, shape, dtype and first values: retrained weights at the same path, or
    models built in memory, differ), the KV dtype, bits and group size (kv.bits, kv.group_size), the
    layer shapes and the block size."""
    h = hashlib.blake2b(digest_size=12)
    h.update(model_path.encode())
    for name, param in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        sample = param.reshape(-1)[:64]
        h.update(f"{name}{param.shape}{param.dtype}".encode())
        h.update(np.array(sample.view(mx.uint8) if sample.dtype == mx.bfloat16 else sample).tobytes())
    layout = [(s.k_heads, s.k_dim, s.v_heads, s.v_dim) for s in shapes]
    quantized = f"|g{group_size}" if kv_bits else ""  # unquantized: the fingerprint of files written before kv.bits
    h.update(f"{dtype}|{kv_bits}|{block_size}|{layout}{quantized}".encode())
    return h.hexdigest()


def open_disk_tier(config: KVConfig, model_path: str, model: nn.Module, kv_format: KVFormat,
                   shapes: Sequence[LayerShape], block_size: int, runner, blocks: BlockManager) -> "PrefixDiskTier":
    """The disk tier of kv.disk_dir, attached to the prefix cache (`blocks`) and the runner's row ops."""
    key = fingerprint(model_path, model, kv_format.dtype, shapes, block_size, kv_format.bits, kv_format.group_size)
    disk = DiskTier(config.disk_dir, key, max_bytes=int(config.disk_max_gb * (1 << 30)), ttl_s=config.disk_ttl_s,
                    queue_blocks=config.disk_queue_blocks)
    tier = PrefixDiskTier(disk, runner.live, config.disk_policy)
    tier.attach(blocks)
    runner.kv_tier = tier
    log.info("disk tier for prefix-cache blocks: %s (%s, %d blocks on disk, at most %.1f GiB)", disk.dir,
             config.disk_policy, disk.files, config.disk_max_gb)
    return tier


class PrefixDiskTier:
    """BlockManager's `tier` over the block store (cache.LiveKV) and a DiskTier (see the module's docstring)."""

    def __init__(self, disk: DiskTier, store: LiveKV, policy: Policy) -> None:
        self.disk = disk
        self.store = store
        self.policy = policy
        self.manager: BlockManager | None = None
        specs = store.block_specs()  # one per stored array (a quantized K or V: values, scales, biases)
        self._shapes = [shape for shape, _ in specs]
        self._dtypes = [dt for _, dt in specs]
        self._itemsizes = [dt.size for dt in self._dtypes]
        fmt = store.format
        self._dtype = str(fmt.dtype) + (f"/q{fmt.bits}g{fmt.group_size}" if fmt.quantized else "")
        self._persistable: set[int] = set()            # hashes of resident blocks that may go to disk
        self._keyed: dict[int, int] = {}                # block id -> hash keyed since the last row ops
        self._evicted: list[tuple[int, int, tuple[int, ...]]] = []  # (block id, hash, tokens) to save
        # a block read runs inside this: the engine stage's StepDeadline.paused (a read is slow, not hung)
        self.reading: Callable[[], AbstractContextManager] = nullcontext

    def attach(self, manager: BlockManager) -> None:
        self.manager = manager
        manager.tier = self

    def stats(self) -> KVDiskStats:
        d, c = self.disk, self.disk.counters
        return KVDiskStats(dir=str(d.dir), policy=self.policy, files=d.files, bytes=d.nbytes, hits=c.hits,
                           misses=c.misses, read_bytes=c.read_bytes, written=c.written, written_bytes=c.written_bytes,
                           dropped=c.dropped, corrupt_files=c.corrupt_files, expired=c.expired, evicted=c.evicted,
                           errors=c.errors, queue_depth=d.queue_depth)

    # ------------------------------------------------------------------ BlockManager's hooks
    def stored(self, block_id: int, key: int, tokens: tuple[int, ...], adapter: str) -> None:
        """A block got key `key`; write-through saves it with the next row ops."""
        self._keyed[block_id] = key
        if adapter == "":
            self._persistable.add(key)
        else:
            self._persistable.discard(key)

    def evicting(self, block_id: int, key: int, tokens: tuple[int, ...]) -> None:
        """Cached block `block_id` is about to be reused: its KV is read before the next pass writes
        into it and saved (evict_only)."""
        if key not in self._persistable:
            return
        self._persistable.discard(key)
        self._keyed.pop(block_id, None)
        if self.policy == "evict_only" and not self.disk.contains(key):
            self._evicted.append((block_id, key, tokens))

    def fetch(self, parent: int, tokens: tuple[int, ...], adapter: str, keep: Sequence[int]) -> int | None:
        """The id of a store block now holding the block after `parent` with `tokens`, read from disk and
        installed as a cached block (no reference taken), or None (not on disk, unreadable, no room)."""
        if adapter != "" or self.manager is None:
            return None
        with self.reading():
            return self._fetch(block_hash(parent, tokens, adapter), tokens, keep)

    def _fetch(self, key: int, tokens: tuple[int, ...], keep: Sequence[int]) -> int | None:
        got = self.disk.get(key, tokens, self._itemsizes)
        if got is None:
            return None
        header, arrays = got
        if [tuple(s) for s in header.shapes] != self._shapes or header.dtype != self._dtype:
            return None
        block_id = self.manager.install(key, tokens, keep)
        if block_id is None:
            return None
        self._save_evicted()  # the block taken may hold KV still to be saved
        data = [mx.array(a).view(dt).reshape(shape) for a, dt, shape in zip(arrays, self._dtypes, self._shapes)]
        self.store.write_block(block_id, data)
        self._persistable.add(key)
        self._keyed.pop(block_id, None)
        return block_id

    def forget(self) -> None:
        """The prefix cache forgot every block (BlockManager.reset)."""
        self._persistable.clear()
        self._keyed.clear()
        self._evicted.clear()

    # ------------------------------------------------------------------ the runner's hooks
    def before_ops(self) -> None:
        self._save_evicted()

    def after_ops(self) -> None:
        """Write-through saves the blocks keyed since the last row ops: the passes that wrote their KV
        were launched before they were keyed (reading it waits for them)."""
        keyed, self._keyed = self._keyed, {}
        if not keyed or self.manager is None or self.policy != "write_through":
            return
        save = []
        for bid, key in keyed.items():
            block = self.manager.blocks[bid]
            if block.hash != key:
                continue
            if self.policy == "write_through" and key in self._persistable and not self.disk.contains(key):
                save.append((bid, key, block.token_ids))
        self._save(save)

    def spill(self, deadline_s: float = 30.0) -> int:
        """Queue every cached block not on disk yet (evict_only at shutdown: the store's blocks leave
        memory now), waiting for room in the writer's queue up to `deadline_s` in all; how many."""
        if self.manager is None:
            return 0
        self._save_evicted()
        blocks = [(b.block_id, b.hash, b.token_ids) for b in self.manager.blocks
                  if b.hash in self._persistable and not self.disk.contains(b.hash)]
        end = time.monotonic() + deadline_s
        queued = 0
        for i in range(0, len(blocks), 64):
            left = end - time.monotonic()
            if left <= 0:
                break
            queued += self._save(blocks[i:i + 64], wait_s=left)
        return queued

    def _save_evicted(self) -> None:
        evicted, self._evicted = self._evicted, []
        self._save(evicted)

    def _save(self, blocks: list[tuple[int, int, tuple[int, ...]]], wait_s: float = 0.0) -> int:
        """Read blocks' KV from the store (one evaluation) and queue it for the disk writer; how many
        were queued."""
        if not blocks:
            return 0
        reads = self.store.read_blocks([bid for bid, _, _ in blocks])
        queued = 0
        for (_, key, tokens), arrays in zip(blocks, reads):
            header = BlockHeader(self.disk.fingerprint, key, list(tokens), self._dtype, self._shapes)
            queued += self.disk.put(key, header, [np.array(a.view(mx.uint8)).reshape(-1) for a in arrays], wait_s)
        return queued
