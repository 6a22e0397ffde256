"""The disk tier's files and store (engine/kv_files.py, engine/disk_tier.py), without a model: round
trips, torn and corrupt files (deleted, counted, never served), a writer killed mid-write, TTL, the
size bound and the writer's bounded queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from parallm.engine.disk_tier import DiskTier
from parallm.engine.kv_files import BlockHeader, CorruptBlock, decode_block, encode_block

FP = "f" * 24
SHAPES = [(2, 4, 8), (2, 4, 8)]  # K and V of one layer: [heads, block_size, dim], float32


def block(key: int, seed: int = 0) -> tuple[BlockHeader, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s, dtype=np.float32).view(np.uint8).reshape(-1) for s in SHAPES]
    return BlockHeader(FP, key, [1, 2, 3, 4], "mlx.core.float32", SHAPES), arrays


def tier(tmp_path, **kw) -> DiskTier:
    kw.setdefault("max_bytes", 1 << 30)
    return DiskTier(tmp_path, FP, **kw)


def test_file_round_trip_and_every_kind_of_damage_is_caught():
    header, arrays = block(7)
    data = encode_block(header, [a.tobytes() for a in arrays])
    got, back = decode_block(data, FP, 7, (1, 2, 3, 4), itemsize=4)
    assert got == header and all((a == b).all() for a, b in zip(arrays, back))
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    for bad in (data[:-9], data[:20], bytes(flipped), b"x" + data[1:]):
        with pytest.raises(CorruptBlock):
            decode_block(bad, FP, 7, (1, 2, 3, 4), itemsize=4)
    with pytest.raises(CorruptBlock, match="another block"):
        decode_block(data, FP, 8, None, itemsize=4)
    with pytest.raises(CorruptBlock, match="another block"):
        decode_block(data, "0" * 24, 7, None, itemsize=4)
    with pytest.raises(CorruptBlock, match="token ids"):
        decode_block(data, FP, 7, (1, 2, 3, 5), itemsize=4)


def test_put_get_survives_a_new_tier_on_the_same_directory(tmp_path):
    t = tier(tmp_path)
    header, arrays = block(11)
    assert t.put(11, header, arrays) and not t.put(11, header, arrays)  # queued once
    t.close()
    assert t.counters.written == 1
    again = tier(tmp_path)
    assert again.files == 1 and again.contains(11)
    got = again.get(11, (1, 2, 3, 4), 4)
    assert got is not None and all((a == b).all() for a, b in zip(arrays, got[1]))
    assert again.get(12, (1, 2, 3, 4), 4) is None
    assert (again.counters.hits, again.counters.misses) == (1, 1)
    again.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_file_is_dropped_counted_and_never_served(tmp_path, damage):
    t = tier(tmp_path)
    t.put(5, *block(5))
    t.close()
    path = t.path(5)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        path.write_bytes(b"")
    again = tier(tmp_path)
    assert again.get(5, (1, 2, 3, 4), 4) is None
    assert again.counters.corrupt_files == 1 and again.counters.hits == 0
    assert not path.exists() and not again.contains(5)
    again.close()


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from parallm.engine import kv_files
    from parallm.engine.disk_tier import DiskTier
    from parallm.engine.kv_files import BlockHeader
    slow = kv_files.write_atomic
    def write_slowly(path, data):  # a writer killed between the temporary file and its rename
        tmp = path.with_name(f".{path.name}.{__import__('os').getpid()}{kv_files.TMP_SUFFIX}")
        tmp.write_bytes(data[:len(data) // 2])
        print("writing", flush=True)
        __import__('time').sleep(60)
    import parallm.engine.disk_tier as dt
    t = DiskTier(sys.argv[1], sys.argv[2], max_bytes=1 << 30)
    shapes = [(2, 4, 8), (2, 4, 8)]
    arrays = [np.zeros(s, np.float32).view(np.uint8).reshape(-1) for s in shapes]
    t.put(1, BlockHeader(sys.argv[2], 1, [1, 2, 3, 4], "mlx.core.float32", shapes), arrays)
    t.flush()
    dt.write_atomic = write_slowly
    t.put(2, BlockHeader(sys.argv[2], 2, [1, 2, 3, 4], "mlx.core.float32", shapes), arrays)
    __import__('time').sleep(60)
""")


def test_a_writer_killed_mid_write_leaves_nothing_servable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), FP], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    leftovers = [p for p in (tmp_path / FP).rglob("*") if p.name.endswith(".tmp")]
    assert len(leftovers) == 1
    t = tier(tmp_path)
    assert t.counters.corrupt_files == 1 and not any(p.exists() for p in leftovers)
    assert t.contains(1) and not t.contains(2)
    assert t.get(2, (1, 2, 3, 4), 4) is None and t.get(1, (1, 2, 3, 4), 4) is not None
    t.close()


def test_files_unused_past_the_ttl_expire(tmp_path):
    now = [1000.0]
    t = tier(tmp_path, ttl_s=10, clock=lambda: now[0])
    t.put(3, *block(3))
    t.flush()
    now[0] += 5
    assert t.get(3, (1, 2, 3, 4), 4) is not None  # a read renews it
    now[0] += 9
    assert t.contains(3)
    now[0] += 11
    assert not t.contains(3) and t.counters.expired == 1 and not t.path(3).exists()
    t.close()


def test_the_size_bound_drops_the_least_recently_used(tmp_path):
    one = len(encode_block(*[block(1)[0], [a.tobytes() for a in block(1)[1]]]))
    t = tier(tmp_path, max_bytes=int(2.5 * one))
    for key in (1, 2):
        t.put(key, *block(key))
        t.flush()
        time.sleep(0.01)
    assert t.get(1, (1, 2, 3, 4), 4) is not None  # 1 is now more recent than 2
    t.put(3, *block(3))
    t.flush()
    assert t.contains(1) and t.contains(3) and not t.contains(2)
    assert t.counters.evicted == 1 and t.nbytes <= 2.5 * one
    t.close()


def test_a_full_queue_drops_and_counts_instead_of_waiting(tmp_path, monkeypatch):
    gate = threading.Event()
    t = tier(tmp_path, queue_blocks=2)
    real = t._write
    monkeypatch.setattr(t, "_write", lambda item: (gate.wait(10), real(item)))
    start = time.monotonic()
    results = [t.put(key, *block(key)) for key in range(1, 7)]
    assert time.monotonic() - start < 1.0
    assert results[:2] == [True, True] and t.counters.dropped >= 3
    gate.set()
    t.close()
    assert t.counters.written == sum(results)
