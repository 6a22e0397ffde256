"""End to end (issue 38, item 5, one engine): an engine process that hangs alive inside a step is restarted
within its step's deadline (parallm/engine/step_deadline.py, the same one a tensor-parallel group's rank 0
gives), every request in flight ends with a retryable 503, and the new engine serves the same greedy text.
Its own small server: the tiny random-weight llama of test_parallel.py, one engine process."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from .server import Server
from .test_parallel import assert_retryable, build_tiny_llama, complete_all, pid_alive, start_under_load

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HANG_BOUND_S = 15.0  # every request in flight ends within this of the engine's SIGSTOP (the default deadline's bound)
SAID = r"engine is hung: its step ran past its ([0-9.]+) s deadline"


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("hang") / "tiny-llama")
    with Server("--model", str(model), "--model.served-name", "m", "--supervisor.restart-backoff-s", "0.2") as srv:
        yield srv


def stop_under_load(server: Server, pid: int) -> tuple[list, float, float]:
    """Eight requests decoding (half streamed), then SIGSTOP of process `pid`: (how each ended, when the
    last ended after the stop, the deadline the supervisor's log says the hung step had). The process is
    let go (SIGCONT) if the supervisor has not killed it within HANG_BOUND_S, so the module's server is not
    left stuck."""
    threads, results = start_under_load(server, steady_s=1.0)  # steady decode steps of eight rows
    said_before = len(re.findall(SAID, server.output()))
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.join(max(0.0, stopped_at + HANG_BOUND_S - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"a request still ran {HANG_BOUND_S} s after the stop: {results}"
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
    last = max(at for at, _ in results) - stopped_at
    found = re.findall(SAID, server.output())
    assert len(found) == said_before + 1, server.output()  # the deadline caught it, not dead_after_s's silence
    return results, last, float(found[-1])


def test_an_engine_that_hangs_alive_under_load_ends_every_request_within_its_deadline_and_serves_again(
        engine_server):
    """SIGSTOP of the engine process mid-step: its heartbeats stop, and the supervisor keeps the deadline of
    the step it last heard of (engine.hang_floor_s 5 s + engine.hang_factor 10 x the recent steps); past it
    the engine is killed and restarted, every request ends with a retryable 503 well before the 10 s of
    supervisor.dead_after_s would have said "silent", and the new engine gives the same greedy text."""
    engine_server.wait_ready(120)
    before = complete_all(engine_server.url, 8)
    pid = engine_server.stage_pids()["engine"]
    results, last, step_deadline = stop_under_load(engine_server, pid)
    print(f"engine stopped: step deadline {step_deadline:.1f} s, the last request ended {last:.2f} s after")
    assert last < min(HANG_BOUND_S, step_deadline + 2.0)  # the deadline, a heartbeat (0.5 s), the 0.1 s poll
    assert_retryable(results)
    engine_server.wait_restarted("engine", pid, 120)
    assert complete_all(engine_server.url, 8) == before
