"""Ingress's ZmqBackend on the pipeline connection, against the scripted far side: each Backend
member is one connection call, and ingress's own duties (admission, timings, the stats poll,
health) stay with it."""

from __future__ import annotations

import asyncio

import pytest

from parallm import protocol
from parallm.api.backend import Backend, BackendError
from parallm.config import build_config
from parallm.metrics import ServerMetrics
from parallm.runtime import StageRuntime
from parallm.stages.ingress import ZmqBackend
from tests._far_side import FarSide, answer


def backend_for(tmp_path, **transport) -> ZmqBackend:
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path), **transport},
                                                 "server": {"max_queued_requests": 2}})
    return ZmqBackend(config, StageRuntime(config, "ingress"), {"max_model_len": 2048}, ServerMetrics())


@pytest.fixture
def far(tmp_path):
    side = FarSide(tmp_path)
    yield side
    side.close()


def text_submit(rid: str, n: int = 1) -> protocol.TextSubmit:
    return protocol.TextSubmit(rid=rid, reply_to=b"", prompt="hi", spec=protocol.RequestSpec(n=n))


async def drain(backend: ZmqBackend, submit: protocol.TextSubmit) -> list[protocol.Output]:
    return [out async for out in backend.generate(submit)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_every_backend_member_is_one_connection_call(tmp_path, far):
    backend = backend_for(tmp_path)
    assert isinstance(backend, Backend)

    async def main():
        await backend.start()
        try:
            outs = await drain(backend, text_submit("r1", n=2))
            assert sorted(o.index for o in outs) == [0, 1] and backend.last_batch_size == 2
            assert (await backend.engine_stats()).running == 3
            assert (await backend.pause("keep")).paused and not (await backend.resume()).paused
            await backend.abort(["r9"])
            loaded = await backend.load_adapter(protocol.AdapterPublish(name="pol", version=3))
            assert (loaded.name, loaded.version) == ("pol", 3)
            with pytest.raises(BackendError) as info:
                await backend.unload_adapter("pol")
            assert (info.value.status, info.value.code) == (404, "adapter_not_found")
            assert (await backend.list_adapters()).policy == {"pol": 4}
            assert await backend.tokenize(protocol.Tokenize(qid="", reply_to=b"", prompt="abc")) == [3]
            assert await backend.detokenize(protocol.Detokenize(qid="", reply_to=b"", ids=protocol.pack_ids([4]))) \
                == "[4]"
            await asyncio.sleep(0.8)  # the stats poll (every STATS_PERIOD_S) feeds /metrics
            assert backend.metrics.engine_stats.running == 3
            assert backend.health()["status"] == "ok" and backend.health()["in_flight"] == 0
        finally:
            await backend.stop()

    run(main())
    submit = far.next(protocol.TextSubmit)
    assert submit.reply_to == backend.identity and submit.spec.submitted_at > 0
    assert far.next(protocol.Abort).rids == ["r9"]
    metrics = backend.metrics.render().decode()
    assert "parallm_time_to_first_token_seconds_count 1.0" in metrics
    assert "parallm_request_duration_seconds_count 2.0" in metrics  # one per finished sample


def test_admission_draining_stage_down_queue_bound_and_full_tokenizer_queue(tmp_path, far):
    far.script = lambda stage, m: [] if isinstance(m, protocol.TextSubmit) else answer(stage, m)
    backend = backend_for(tmp_path)

    async def refused(rid: str) -> BackendError:
        with pytest.raises(BackendError) as info:
            await drain(backend, text_submit(rid))
        return info.value

    async def main():
        await backend.start()
        try:
            await asyncio.sleep(0.3)  # the control subscription reaches the publisher
            running = asyncio.create_task(drain(backend, text_submit("lost")))
            await asyncio.sleep(0.2)
            assert backend.health()["in_flight"] == 1
            far.announce(protocol.StageDown(stage="detokenizer"))
            with pytest.raises(BackendError) as info:
                await running
            assert (info.value.status, info.value.code, info.value.retryable) == (503, "stage_restarted", True)
            error = await refused("while-down")
            assert (error.status, error.code) == (503, "service_unavailable")
            assert backend.health()["status"] == "degraded" and backend.health()["stages_down"] == ["detokenizer-0"]
            far.announce(protocol.StageUp(stage="detokenizer"))
            await asyncio.sleep(0.2)
            backend.metrics.set_stats(protocol.EngineStats(waiting=2))
            for task in backend.tasks:  # keep the poll from replacing the stats set here
                if task.get_name() == "ingress-stats":
                    task.cancel()
            assert (await refused("queued")).code == "queue_full"
            assert backend.health()["status"] == "overloaded"
            backend.metrics.set_stats(protocol.EngineStats(waiting=0))
            backend.rt.draining = True
            assert (await refused("draining")).code == "shutting_down"
            backend.rt.draining = False
        finally:
            await backend.stop()

    run(main())
    metrics = backend.metrics.render().decode()
    assert 'parallm_stage_restarts_total{stage="detokenizer"} 1.0' in metrics
    assert 'parallm_requests_rejected_total{reason="queue_full"} 1.0' in metrics


def test_a_full_tokenizer_queue_is_a_retryable_503(tmp_path, far):
    far.addresses["tokenizers"] = f"ipc://{tmp_path}/nobody.sock"  # requests queue in the pipe, up to the hwm
    backend = backend_for(tmp_path, hwm=1)

    async def main():
        await backend.start()
        try:
            queued = asyncio.create_task(drain(backend, text_submit("r1")))
            await asyncio.sleep(0.1)
            with pytest.raises(BackendError) as info:
                await drain(backend, text_submit("r2"))
            assert (info.value.status, info.value.code, info.value.retryable) == (503, "overloaded", True)
            assert backend.health()["in_flight"] == 1 and not queued.done()
            queued.cancel()
        finally:
            await backend.stop()

    run(main())
