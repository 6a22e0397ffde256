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
