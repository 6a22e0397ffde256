"""The heartbeat thread of a stage's runtime ends quietly when the stage closes or its context is destroyed
(it used to loop forever and die with "Socket operation on non-socket" once the context went away)."""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
import zmq

from parallm import protocol
from parallm.config import build_config
from parallm.runtime import StageRuntime
from parallm.transport import Receiver, open_socket


def runtime(ctx: zmq.Context) -> tuple[StageRuntime, Receiver]:
    config = build_config(environ={}, overrides={"transport": {"run_dir": tempfile.mkdtemp(prefix="beat-")},
                                                 "supervisor": {"heartbeat_s": 0.05}})
    rt = StageRuntime(config, "tokenizer", ctx=ctx)
    supervisor = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.supervisor, bind=True), protocol.SupervisorInbound)
    return rt, supervisor


def beats(supervisor: Receiver, wait_s: float = 0.5) -> int:
    deadline, count = time.monotonic() + wait_s, 0
    while time.monotonic() < deadline:
        count += sum(isinstance(m, protocol.Heartbeat) for m in supervisor.drain())
        time.sleep(0.02)
    return count


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "heartbeat"]


@pytest.mark.parametrize("end", ["close", "destroy"])
def test_the_heartbeat_thread_ends_quietly(end):
    failures: list = []
    hook, threading.excepthook = threading.excepthook, failures.append
    try:
        before = set(heartbeat_threads())
        ctx = zmq.Context()
        rt, supervisor = runtime(ctx)
        rt.heartbeat()
        assert beats(supervisor) >= 3  # the thread beats on its own
        (thread,) = set(heartbeat_threads()) - before
        if end == "close":
            rt.close()
            thread.join(2)
            supervisor.close()
            ctx.term()
        else:
            ctx.destroy(0)
            thread.join(2)
        assert not thread.is_alive() and failures == []
    finally:
        threading.excepthook = hook
