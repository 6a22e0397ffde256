"""The benchmarks' two HTTP clients (perf/loadgen.py: the lean one and httpx) read the same streams from the
real server: every request ends, with the same tokens, and TTFT/ITLs are timed from the events."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from perf.loadgen import Workload, run_http

pytestmark = pytest.mark.e2e


def test_lean_and_httpx_clients_read_the_same_streams(server):
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    workload = Workload("clients", prompt_words=12, max_tokens=12, requests=6)
    runs = {client: asyncio.run(run_http(server.url, model, workload, 3, [2], seed=5, http_client=client))
            for client in ("lean", "httpx")}
    for client, run in runs.items():
        assert (run["ok"], run["errors"], run["http_client"]) == (6, [], client)
        assert run["output_tokens"] == 6 * 12  # EOS suppressed: every request runs its full length
        assert run["ttft_p50_s"] > 0 and run["itl_p50_s"] > 0
    bad = asyncio.run(run_http(server.url, "no-such-model", Workload("bad", 4, 4, 2), 2, [2], http_client="lean"))
    assert (bad["ok"], bad["errors"]) == (0, ["HTTP 404"])
