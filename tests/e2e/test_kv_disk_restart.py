"""The KV disk tier and admission by pressure on real servers (issue 41), parallm-launch on the default
model: a server killed with SIGKILL right after its requests (the writer possibly mid-write) and one
of its block files corrupted; a new server on the same --kv.disk-dir serves a prompt sharing a
~1,000-token prefix with one served before at <= 0.25x the TTFT of a cold one, gives the same tokens
as before for every prefix (the corrupt block recomputed, dropped and counted), answers a burst
past --kv.pressure-threshold with only 200s and retryable 503s, and the engine's check_integrity
(run by its stage each time it goes idle) never failed."""

from __future__ import annotations

import os
import signal
import statistics
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from perf.bench_kv_disk import SUFFIX_TOKENS, complete, random_ids, ttft, wait_idle_checked

from .server import Server

pytestmark = pytest.mark.slow  # two server starts and 1,000-token prefills: ~1 min on two cores

PREFIX = 1000


def flags(disk_dir) -> list[str]:
    return ["--kv.disk-dir", str(disk_dir), "--kv.disk-policy", "write_through", "--engine.kv-budget-mb", "256",
            "--kv.pressure-threshold", "0.5", "--engine.max-num-seqs", "16"]


def test_blocks_survive_a_killed_server_and_a_burst_gets_200_or_503(tmp_path):
    prefixes = [random_ids(PREFIX, seed=100 + i) for i in range(3)]
    suffix = random_ids(SUFFIX_TOKENS, seed=1)
    first = Server(*flags(tmp_path)).start()
    try:
        before = [complete(first.url, p + suffix) for p in prefixes]
    finally:
        os.killpg(first.proc.pid, signal.SIGKILL)  # the whole server at once, its writer maybe mid-write
        first.stop()
    files = sorted(tmp_path.rglob("*.kv"), key=lambda p: p.stat().st_mtime)
    assert len(files) >= 62, "write_through wrote the first prefix's blocks before the kill"
    victim = files[10]  # a block of the first prefix
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    with Server(*flags(tmp_path)) as second:
        cold, warm = [], []
        for i in (1, 2):
            cold.append(ttft(second.url, random_ids(PREFIX, seed=500 + i) + suffix))
            warm.append(ttft(second.url, prefixes[i] + random_ids(SUFFIX_TOKENS, seed=2)))
        assert statistics.median(warm) <= 0.25 * statistics.median(cold), (cold, warm)
        after = [complete(second.url, p + suffix) for p in prefixes]
        assert after == before  # the corrupt block was recomputed, the others read back
        stats = wait_idle_checked(second)
        assert stats["disk"]["hits"] >= 2 * 62 and stats["disk"]["corrupt_files"] >= 1
        assert not victim.exists() or victim.read_bytes() != bytes(data)

        def one(i: int) -> httpx.Response:
            body = {"prompt": random_ids(600, seed=900 + i), "max_tokens": 8, "temperature": 0.0}
            return httpx.post(f"{second.url}/v1/completions", json=body, timeout=300)

        with ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(one, range(24)))
        statuses = [r.status_code for r in answers]
        assert set(statuses) == {200, 503}, statuses
        refused = next(r for r in answers if r.status_code == 503)
        assert refused.headers.get("retry-after") and refused.json()["error"]["code"] == "kv_pressure"
        stats = wait_idle_checked(second)
        assert stats["integrity_checks"] > 0 and stats["integrity_failures"] == 0
