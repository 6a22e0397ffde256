"""The KV disk tier and admission by pressure on real servers (issue 41), parallm-launch on the default
model: a server killed with SIGKILL right after its requests (the writer possibly mid-write) and one
of its block files corrupted; a new server on the same --kv.disk-dir serves a prompt sharing a
~1,000-token prefix with one served before at <= 0.25x the TTFT of a cold one, gives the same tokens
as before for every prefix (the corrupt block recomputed, dropped and counted), answers a burst
past --kv.pressure-threshold with only 200s and retryable 503s, and the engine's check_integrity
(run by its stage each time it goes idle) never failed."""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from .server import Server

pytestmark = pytest.mark.slow  # two server starts and 1,000-token prefills: ~1 min on two cores

PREFIX = 1000
SUFFIX_TOKENS = 8


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def openai_at(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def ttft(server: Server, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion of token ids to its first text."""
    client = openai_at(server)
    model = client.models.list().data[0].id  # asked before the clock starts: TTFT is the completion's alone
    start = time.perf_counter()
    first = None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0.0, stream=True):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
    assert first is not None, "the stream ended without text"
    return first


def complete(server: Server, prompt: list[int]) -> list[int]:
    """Greedy token ids (vLLM's return_token_ids)."""
    client = openai_at(server)
    answer = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=4,
                                       temperature=0.0, extra_body={"return_token_ids": True})
    return answer.choices[0].model_extra["token_ids"]


def wait_idle_checked(server: Server) -> dict[str, Any]:
    stats = server.engine_stats_after_idle_check()
    return {"disk": {f: getattr(stats.kv_disk, f) for f in stats.kv_disk.__struct_fields__},
            "integrity_checks": stats.integrity_checks, "integrity_failures": stats.integrity_failures}


def flags(disk_dir) -> list[str]:
    return ["--kv.disk-dir", str(disk_dir), "--kv.disk-policy", "write_through", "--engine.kv-budget-mb", "256",
            "--kv.pressure-threshold", "0.5", "--engine.max-num-seqs", "16"]


def test_blocks_survive_a_killed_server_and_a_burst_gets_200_or_503(tmp_path):
    prefixes = [random_ids(PREFIX, seed=100 + i) for i in range(3)]
    suffix = random_ids(SUFFIX_TOKENS, seed=1)
    first = Server(*flags(tmp_path)).start()
    try:
        before = [complete(first, p + suffix) for p in prefixes]
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
            cold.append(ttft(second, random_ids(PREFIX, seed=500 + i) + suffix))
            warm.append(ttft(second, prefixes[i] + random_ids(SUFFIX_TOKENS, seed=2)))
        assert statistics.median(warm) <= 0.25 * statistics.median(cold), (cold, warm)
        after = [complete(second, p + suffix) for p in prefixes]
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
