"""The disk tier of the prefix cache: block files in a directory, written by a thread of their own.

Knows nothing of MLX or of the block store (prefix_tier.py connects them): a block is its chained
hash (blocks.block_hash), its token ids and its KV bytes. `put` queues a block for the writer
thread and never waits: past `queue_blocks` waiting it drops the block and counts it, so a slow
disk costs cache hits, never step time. `get` reads a block back on the caller's thread and
verifies it (kv_files.decode_block): a torn or corrupt file is deleted and counted, never served.

Files live under DIR/<fingerprint>/<2 hex digits>/<hash>.kv; the fingerprint (of the model, its
weights, the KV dtype and layout, prefix_tier.fingerprint) keeps blocks of another model or KV
format apart. The index (hash -> size, last use) is rebuilt from the directory at start, which is
what makes the tier survive restarts; a file another process (an engine replica sharing the
directory) wrote later is found on its first lookup. Files unused for `ttl_s` expire; past
`max_bytes` the least recently used go. Leftover temporary files of a writer killed mid-write are
deleted at start and counted as torn.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .kv_files import SUFFIX, TMP_SUFFIX, BlockHeader, CorruptBlock, decode_block, encode_block, write_atomic

log = logging.getLogger("parallm.engine")


@dataclass(slots=True)
class DiskCounters:
    """What the tier did since it started (EngineStats.kv_disk)."""

    hits: int = 0            # blocks read back (served instead of recomputed)
    misses: int = 0          # blocks looked up and not on disk
    read_bytes: int = 0
    written: int = 0         # blocks written
    written_bytes: int = 0
    dropped: int = 0         # blocks not written: the writer's queue was full
    corrupt_files: int = 0   # torn or corrupt files found (deleted, never served)
    expired: int = 0         # files deleted after ttl_s unused
    evicted: int = 0         # files deleted to stay within max_bytes
    errors: int = 0          # writes that failed (disk full, permissions)


@dataclass(slots=True)
class _Pending:
    block_hash: int
    header: BlockHeader
    arrays: list[np.ndarray] = field(default_factory=list)


class DiskTier:
    def __init__(self, root: str | os.PathLike, fingerprint: str, *, max_bytes: int, ttl_s: float = 0.0,
                 queue_blocks: int = 1024, clock: Callable[[], float] = time.time) -> None:
        self.fingerprint = fingerprint
        self.dir = Path(root).expanduser() / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[int, tuple[int, float]] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._queued: set[int] = set()
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=queue_blocks)
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ lookups (the engine's thread)
    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash >> 55:02x}" / f"{block_hash:016x}{SUFFIX}"

    def contains(self, block_hash: int) -> bool:
        """Whether a live (unexpired) file for the block is on disk or queued for writing."""
        with self._lock:
            if block_hash in self._queued:
                return True
            entry = self._index.get(block_hash)
        if entry is None:
            try:  # written by another process sharing the directory since the scan
                st = self.path(block_hash).stat()
            except OSError:
                return False
            with self._lock:
                self._add(block_hash, st.st_size, st.st_mtime)
            entry = (st.st_size, st.st_mtime)
        if self._expired(entry[1]):
            self._delete(block_hash, "expired")
            return False
        return True

    def get(self, block_hash: int, token_ids: tuple[int, ...],
            itemsize: int | list[int]) -> tuple[BlockHeader, list[np.ndarray]] | None:
        """The block's header and arrays (uint8, one per layer's K then V) read back and verified, or
        None: not on disk (a miss), or torn/corrupt/another block (deleted and counted)."""
        if not self.contains(block_hash):
            self.counters.misses += 1
            return None
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # queued, not written yet; or deleted by another process
            self.counters.misses += 1
            return None
        except OSError as exc:
            log.warning("disk tier: cannot read %s: %s", path, exc)
            self.counters.misses += 1
            return None
        try:
            got = decode_block(data, self.fingerprint, block_hash, token_ids, itemsize)
        except CorruptBlock as exc:
            log.warning("disk tier: dropped %s: %s", path.name, exc)
            self._delete(block_hash, "corrupt_files")
            self.counters.misses += 1
            return None
        now = self.clock()
        with self._lock:
            if block_hash in self._index:
                self._index[block_hash] = (len(data), now)
                self._index.move_to_end(block_hash)
        try:
            os.utime(path, (now, now))  # last use survives a restart (ttl_s, least recently used)
        except OSError:
            pass
        self.counters.hits += 1
        self.counters.read_bytes += len(data)
        return got

    # ------------------------------------------------------------------ writes (queued)
    def put(self, block_hash: int, header: BlockHeader, arrays: list[np.ndarray], wait_s: float = 0.0) -> bool:
        """Queue a block for the writer thread; False if it is already on disk or queued, or was
        dropped because the queue stayed full for `wait_s` (0: not at all; counted)."""
        with self._lock:
            if block_hash in self._queued or block_hash in self._index:
                return False
            self._queued.add(block_hash)
        try:
            self._queue.put(_Pending(block_hash, header, arrays), block=wait_s > 0, timeout=wait_s or None)
        except queue.Full:
            with self._lock:
                self._queued.discard(block_hash)
            self.counters.dropped += 1
            return False
        return True

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def files(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (or `timeout`); whether the queue emptied."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to `timeout`), then stop the writer thread."""
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return
        self._thread.join(timeout=1.0)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:  # noqa: BLE001 - a failed write costs a block, never the writer
                self.counters.errors += 1
                log.exception("disk tier: writing block %016x failed", item.block_hash if item else 0)
            finally:
                if item is not None:
                    with self._lock:
                        self._queued.discard(item.block_hash)
                self._queue.task_done()

    def _write(self, item: _Pending) -> None:
        data = encode_block(item.header, [a.tobytes() for a in item.arrays])
        path = self.path(item.block_hash)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        try:
            write_atomic(path, data)
        except OSError as exc:
            self.counters.errors += 1
            log.warning("disk tier: cannot write %s: %s", path, exc)
            return
        self.counters.written += 1
        self.counters.written_bytes += len(data)
        with self._lock:
            self._add(item.block_hash, len(data), self.clock())
            over = []
            while self._bytes > self.max_bytes and len(self._index) > 1:
                oldest = next(iter(self._index))
                over.append(oldest)
                self._forget(oldest)
        for block_hash in over:
            self.path(block_hash).unlink(missing_ok=True)
            self.counters.evicted += 1

    # ------------------------------------------------------------------ the index
    def _add(self, block_hash: int, size: int, stamp: float) -> None:
        if block_hash in self._index:
            self._forget(block_hash)
        self._index[block_hash] = (size, stamp)
        self._bytes += size

    def _forget(self, block_hash: int) -> None:
        size, _ = self._index.pop(block_hash)
        self._bytes -= size

    def _expired(self, stamp: float) -> bool:
        return bool(self.ttl_s) and self.clock() - stamp > self.ttl_s

    def _delete(self, block_hash: int, counter: str) -> None:
        with self._lock:
            if block_hash in self._index:
                self._forget(block_hash)
        self.path(block_hash).unlink(missing_ok=True)
        setattr(self.counters, counter, getattr(self.counters, counter) + 1)

    def _scan(self) -> None:
        """Rebuild the index from the directory: expired files and a killed writer's temporary files go."""
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                name = path.name
                if name.endswith(TMP_SUFFIX):
                    if not _writer_alive(name):
                        path.unlink(missing_ok=True)
                        self.counters.corrupt_files += 1
                    continue
                if not name.endswith(SUFFIX):
                    continue
                try:
                    block_hash = int(name[:-len(SUFFIX)], 16)
                    st = path.stat()
                except (ValueError, OSError):
                    continue
                if self._expired(st.st_mtime):
                    path.unlink(missing_ok=True)
                    self.counters.expired += 1
                    continue
                found.append((st.st_mtime, block_hash, st.st_size))
        for stamp, block_hash, size in sorted(found):
            self._add(block_hash, size, stamp)
        if found or self.counters.corrupt_files:
            log.info("disk tier %s: %d blocks (%.1f MiB)%s", self.dir, len(self._index), self._bytes / (1 << 20),
                     f", {self.counters.corrupt_files} torn files deleted" if self.counters.corrupt_files else "")


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that is writing temporary file `tmp_name` (kv_files.write_atomic names it
    .<file>.<pid>.tmp) still runs (another engine replica sharing the directory)."""
    try:
        pid = int(tmp_name[:-len(TMP_SUFFIX)].rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
