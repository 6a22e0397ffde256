"""Ingress's background loops are restarted when they fail, never left dead (issue 22): the training
reader that raised on one status goes on recording the next."""

from __future__ import annotations

import asyncio

import zmq

from parallm import protocol
from test_ingress_backend import backend_for, far, run  # noqa: F401  (far: the fixture)


def test_a_failed_training_reader_is_restarted(tmp_path, far):
    backend = backend_for(tmp_path)
    real = backend.metrics.set_training_status
    calls = []

    def flaky(status):
        calls.append(status["trainer"])
        if len(calls) == 1:
            raise RuntimeError("boom")
        real(status)

    backend.metrics.set_training_status = flaky
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(backend.rt.addrs.training)

    async def main():
        await backend.start()
        try:
            for name in ("first", "second"):
                push.send(protocol.encode(protocol.TrainingStatus(trainer=name, adapter="policy")))
                for _ in range(100):
                    if name in calls and (name == "first" or "second" in backend.trainers):
                        break
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # the restart's pause
            return dict(backend.task_restarts), sorted(backend.trainers), [t.done() for t in backend.tasks]
        finally:
            await backend.stop()

    try:
        restarts, trainers, done = run(main())
    finally:
        push.close(0)
        ctx.term()
    assert restarts == {"_read_training": 1}
    assert "second" in trainers and not any(done)


def test_a_malformed_training_status_is_dropped_and_counted(tmp_path, far):
    """Issue 22: every decode failure dropped and counted — ingress' training socket too
    (/metrics parallm_dropped_frames{stage="ingress"}), and the reader goes on."""
    backend = backend_for(tmp_path)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(backend.rt.addrs.training)

    async def main():
        await backend.start()
        try:
            push.send(b"\x81\xa1a" * 100_000 + b"\xc0")  # a map nested 100,000 deep
            push.send(protocol.encode(protocol.TrainingStatus(trainer="after", adapter="policy")))
            for _ in range(200):
                if "after" in backend.trainers:
                    break
                await asyncio.sleep(0.02)
            return sorted(backend.trainers), backend.metrics.render().decode()
        finally:
            await backend.stop()

    try:
        trainers, text = run(main())
    finally:
        push.close(0)
        ctx.term()
    assert trainers == ["after"]
    assert 'parallm_dropped_frames{stage="ingress"} 1.0' in text
