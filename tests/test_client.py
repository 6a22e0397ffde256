"""The pipeline connection and the two clients on it, against a scripted far side (real ZeroMQ
sockets in this process standing in for the router, the engine, a tokenizer and the supervisor's
control channel): dispatch by rid and qid, streams that end, abort when left or idle, stage
failures, malformed frames, a failing reader, and the two clients' identical surfaces."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import threading
import time
from typing import Any

import pytest
import zmq

from parallm import protocol
from parallm.client import AsyncClient, Client, ClientError, StageFailure
from parallm.pipeline import Pipeline
from parallm.protocol import SamplingParams
from tests._far_side import FarSide, answer


@pytest.fixture
def far(tmp_path):
    side = FarSide(tmp_path)
    yield side
    side.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# --------------------------------------------------------------------------- the two surfaces

def public(client: Any) -> dict[str, Any]:
    """Every public name of a client: its parameters if it is a method, else "data"."""
    members = {}
    for name in dir(client):
        if name.startswith("_"):
            continue
        member = getattr(type(client), name, None)
        if callable(member):
            members[name] = [(p.name, p.kind, p.default, p.annotation)
                             for p in inspect.signature(member).parameters.values()]
        else:
            members[name] = "data"
    return members


def test_sync_and_async_clients_offer_the_same_operations_with_the_same_parameters(far):
    asynchronous = AsyncClient(far.addresses["router"])
    with Client(far.addresses["router"]) as client:
        sync, asyn = public(client), public(asynchronous)
    run(asynchronous.close())
    assert sync == asyn
    assert set(sync) == {"connect", "close", "submit", "stream", "result", "generate", "generate_group", "abort",
                         "score", "pool", "stats", "policy", "list_adapters", "load_adapter", "unload_adapter", "pause",
                         "resume", "tokenize", "detokenize", "model", "welcome", "router", "timeout", "identity"}
    for name, member in sync.items():
        if member != "data" and name != "stream":
            assert inspect.iscoroutinefunction(getattr(AsyncClient, name)), name
            assert not inspect.iscoroutinefunction(getattr(Client, name)), name
    assert inspect.isasyncgenfunction(AsyncClient.stream) and inspect.isgeneratorfunction(Client.stream)


# --------------------------------------------------------------------------- requests

def test_outputs_reach_their_own_stream_which_ends_after_n_finishes(far):
    def script(stage, message):
        if isinstance(message, protocol.Submit):
            return []  # answered below, interleaved
        return answer(stage, message)

    far.script = script

    async def main():
        async with AsyncClient(far.addresses["router"], timeout=10) as client:
            first = await client.submit([1, 2], SamplingParams(max_tokens=2), n=2)
            second = await client.submit([3], SamplingParams(max_tokens=1))
            out = lambda rid, i, tok, fin=None: protocol.Output(rid=rid, index=i, token_ids=protocol.pack_ids([tok]),
                                                                 finish_reason=fin)
            identity = client.identity
            far.send(identity, protocol.Outputs(items=[out(first, 0, 10), out(second, 0, 30, "stop"),
                                                       out(first, 1, 20)], batch_size=3))
            far.send(identity, protocol.Outputs(items=[out(first, 0, 11, "length"), out(first, 1, 21, "length")], batch_size=3))
            far.send(identity, protocol.Outputs(items=[out(first, 0, 99, "length")], batch_size=3))  # after the end: never read
            a, b = await client.result(first), await client.result(second)
            assert [(s.index, s.token_ids, s.finish_reason) for s in a] == [(0, [10, 11], "length"),
                                                                             (1, [20, 21], "length")]
            assert [(s.token_ids, s.finish_reason) for s in b] == [([30], "stop")]
            assert client._pipeline.in_flight == 0 and client._pipeline.last_batch_size == 3

    run(main())
    submits = [far.next(protocol.Submit) for _ in range(2)]
    assert all(s.reply_to.startswith(b"aclient-") for s in submits)


def test_text_and_chat_prompts_go_through_the_tokenizer_token_ids_to_the_engine(far):
    with Client(far.addresses["router"], timeout=10) as client:
        assert client.model == "scripted"
        client.generate("hello", detok=True, adapter="pol", priority=2)
        client.generate([{"role": "user", "content": "hi"}])
        client.generate([5, 6, 7])
    text = far.next(protocol.TextSubmit)
    assert text.prompt == "hello" and text.spec.detok is not None and (text.spec.adapter, text.spec.priority) == ("pol", 2)
    assert far.next(protocol.TextSubmit).messages == [{"role": "user", "content": "hi"}]
    assert protocol.unpack_ids(far.next(protocol.Submit).prompt_ids) == [5, 6, 7]


def test_bad_request_arguments_are_clear_errors(far):
    with Client(far.addresses["router"], timeout=10) as client:
        with pytest.raises(TypeError, match="unknown request field"):
            client.generate([1], adaptor="typo")
        with pytest.raises(ValueError, match="n must be at least 1"):
            client.generate([1], n=0)
        with pytest.raises(ValueError, match="empty"):
            client.generate([])
        rid = client.submit([1, 2])
        with pytest.raises(TypeError, match="no other arguments"):
            next(client.stream(rid, SamplingParams()))
        assert [o.finish_reason for o in client.stream(rid)] == ["length"]
        with pytest.raises(ValueError, match="already read"):
            client.result(rid)
        with pytest.raises(ValueError, match="already submitted"):
            client.submit([1], rid=client.submit([1], rid="same"))


def test_leaving_a_stream_early_aborts_the_request(far):
    def script(stage, m):
        if isinstance(m, protocol.Submit):  # a first token, then nothing
            return [protocol.Outputs(items=[protocol.Output(rid=m.rid, token_ids=protocol.pack_ids([1]))])]
        return answer(stage, m)

    far.script = script
    with Client(far.addresses["router"], timeout=10) as client:
        for out in client.stream([1, 2, 3], SamplingParams(max_tokens=100)):
            break
        assert far.next(protocol.Abort).rids == [out.rid]

    async def main():
        async with AsyncClient(far.addresses["router"], timeout=10) as client:
            async for out in client.stream([4, 5], SamplingParams(max_tokens=100)):
                break
            await asyncio.sleep(0.05)  # the loop closes an abandoned async generator on its next turn
            return out.rid

    rid = run(main())
    assert far.next(protocol.Abort).rids == [rid]


def test_a_stream_that_hears_nothing_for_timeout_is_aborted(far):
    far.script = lambda stage, m: [] if isinstance(m, protocol.Submit) else answer(stage, m)
    with Client(far.addresses["router"], timeout=0.3) as client:
        t0 = time.monotonic()
        with pytest.raises(StageFailure) as info:
            client.generate([1, 2])
        assert info.value.status == 504 and info.value.retryable and time.monotonic() - t0 < 3
        rid = far.next(protocol.Submit).rid
        assert far.next(protocol.Abort).rids == [rid]


# --------------------------------------------------------------------------- control requests

def test_every_control_request_gets_its_typed_reply(far):
    with Client(far.addresses["router"], timeout=10) as client:
        assert client.stats().running == 3
        assert client.stats("tokenizer").handled == 5
        assert client.stats("detokenizer").outputs == 9
        assert client.score([1, 2, 3, 4], start=2) == {"logprobs": [-0.5, -0.5]}
        assert client.pause("abort").paused is True and client.resume().paused is False
        assert client.policy() == {"": 0, "pol": 4} and client.list_adapters().policy == {"pol": 4}
        assert client.load_adapter("pol", 5, b"weights", {"rank": 8}, make_default=True).version == 5
        assert client.tokenize("abcd") == [4]
        assert client.detokenize([1, 2]) == "[1, 2]"
        with pytest.raises(ClientError) as info:
            client.unload_adapter("nope")
        assert (info.value.status, info.value.code, info.value.retryable) == (404, "adapter_not_found", False)
        with pytest.raises(ValueError, match="no stage"):
            client.stats("trainer")
    publish = far.next(protocol.AdapterPublish)
    assert (publish.weights, publish.config, publish.make_default, publish.format) == (b"weights", {"rank": 8}, True,
                                                                                       "auto")


def test_a_control_request_nobody_answers_times_out(far):
    far.script = lambda stage, m: [] if isinstance(m, protocol.GetStats) else answer(stage, m)
    with Client(far.addresses["router"], timeout=0.5) as client:
        with pytest.raises(StageFailure) as info:
            client.stats()
        assert (info.value.status, info.value.code) == (503, "timeout")
        assert client._client._pipeline._calls == {}


# --------------------------------------------------------------------------- failures

def test_engine_down_fails_every_request_and_engine_query(far):
    far.script = lambda stage, m: [] if isinstance(m, (protocol.Submit, protocol.TextSubmit, protocol.Score)) \
        else answer(stage, m)

    async def main():
        async with AsyncClient(far.addresses["router"], timeout=30) as client:
            await asyncio.sleep(0.3)  # the control subscription reaches the publisher
            tasks = [asyncio.create_task(client.generate([1, 2])), asyncio.create_task(client.generate("text")),
                     asyncio.create_task(client.score([1, 2]))]
            await asyncio.sleep(0.2)
            far.announce(protocol.StageDown(stage="engine"))
            errors = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(e, StageFailure) and e.code == "stage_restarted" and e.retryable for e in errors)
            assert client._pipeline.stages_down == {"engine-0"} and client._pipeline.in_flight == 0
            far.announce(protocol.StageUp(stage="engine"))
            await asyncio.sleep(0.2)
            assert client._pipeline.stages_down == set()

    run(main())


def test_a_restarted_detokenizer_is_up_only_once_its_router_answers_hello(far):
    """The new detokenizer's mandatory ROUTER reads a DEALER that has not reconnected yet as a client gone
    (and aborts its request unanswered), so its StageUp counts only once Hello gets a Welcome back."""
    async def main():
        async with AsyncClient(far.addresses["router"], timeout=30) as client:
            pipeline, heard = client._pipeline, []
            pipeline.add_listener(heard.append)
            await asyncio.sleep(0.3)  # the control subscription reaches the publisher
            far.announce(protocol.StageDown(stage="detokenizer"))
            await asyncio.sleep(0.2)
            assert pipeline.stages_down == {"detokenizer-0"}
            far.welcoming, hellos = False, far.hellos
            far.announce(protocol.StageUp(stage="detokenizer", restarts=1))
            await asyncio.sleep(0.5)
            assert pipeline.stages_down == {"detokenizer-0"}, "up before the new router could route to it"
            assert far.hellos - hellos >= 3 and not any(isinstance(m, protocol.StageUp) for m in heard)
            far.welcoming = True
            await asyncio.sleep(0.3)
            assert pipeline.stages_down == set()
            assert [m for m in heard if isinstance(m, protocol.StageUp)] == [protocol.StageUp(stage="detokenizer", restarts=1)]
            asked = far.hellos
            await asyncio.sleep(0.2)
            assert far.hellos == asked, "Hello goes on after the Welcome"
            assert await client.generate([1, 2])  # the connection serves again

    run(main())


def test_tokenizer_down_fails_only_text_requests_that_heard_nothing(far):
    heard_rid: list[str] = []

    def script(stage, m):
        if isinstance(m, protocol.TextSubmit) and m.prompt == "heard":
            heard_rid.append(m.rid)
            return [protocol.Outputs(items=[protocol.Output(rid=m.rid, token_ids=protocol.pack_ids([1]))])]
        if isinstance(m, (protocol.Submit, protocol.TextSubmit, protocol.Tokenize)):
            return []
        return answer(stage, m)

    far.script = script

    async def main():
        async with AsyncClient(far.addresses["router"], timeout=30) as client:
            await asyncio.sleep(0.3)
            unheard = asyncio.create_task(client.generate("unheard"))
            tokens = asyncio.create_task(client.generate([1, 2, 3]))
            query = asyncio.create_task(client.tokenize("x"))
            heard = await client.submit("heard")
            await asyncio.sleep(0.3)
            far.announce(protocol.StageDown(stage="tokenizer"))
            for task in (unheard, query):
                with pytest.raises(StageFailure, match="tokenizer stage restarted"):
                    await task
            await asyncio.sleep(0.2)
            assert not tokens.done() and client._pipeline.in_flight == 2  # the token-id request and the heard one
            tokens.cancel()
            return heard

    heard = run(main())
    aborted = far.next(protocol.Abort)
    assert heard not in aborted.rids and len(aborted.rids) == 1  # the unheard text request, in case it got through


def test_malformed_frames_are_dropped_and_counted_and_delivery_goes_on(far):
    far.script = lambda stage, m: [] if isinstance(m, protocol.Submit) else answer(stage, m)

    async def main():
        async with AsyncClient(far.addresses["router"], timeout=10) as client:
            rid = await client.submit([1])
            for junk in (b"", b"\xc1", b"not msgpack", protocol.encode(protocol.Hello()), b"\x81\xa4type\xa6outputs"):
                far.send_raw(client.identity, junk)
            far.send(client.identity, protocol.Outputs(items=[protocol.Output(rid=rid, finish_reason="stop")]))
            [result] = await client.result(rid)
            assert result.finish_reason == "stop"
            assert client._pipeline.dropped_frames == 5

    run(main())


def test_a_reader_that_fails_fails_pending_work_loudly_and_restarts(far, caplog):
    far.script = lambda stage, m: [] if isinstance(m, protocol.Submit) and m.spec.params.max_tokens == 99 \
        else answer(stage, m)

    async def main():
        async with AsyncClient(far.addresses["router"], timeout=10) as client:
            pipeline = client._pipeline
            pending = asyncio.create_task(client.generate([1], SamplingParams(max_tokens=99)))
            await asyncio.sleep(0.1)
            real_recv = pipeline._dealer.recv_multipart
            calls = []

            def broken_once(*args, **kwargs):
                if not calls:
                    calls.append(1)
                    raise zmq.ZMQError(zmq.EFAULT, "simulated")
                return real_recv(*args, **kwargs)

            pipeline._dealer.recv_multipart = broken_once
            pipeline._on_readable()  # as when the DEALER's descriptor turns readable
            with pytest.raises(StageFailure) as info:
                await pending
            assert info.value.code == "connection_error"
            await asyncio.sleep(0.3)  # restarted after its backoff
            [ok] = await client.generate([2])
            assert ok.finish_reason == "length" and pipeline.restarts == 1

    run(main())
    assert "reader stopped" in caplog.text


def test_no_welcome_ends_with_a_retryable_error_within_the_deadline(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(StageFailure) as info:
        Client(f"ipc://{tmp_path}/nobody.sock", timeout=1.0)
    assert info.value.status == 503 and info.value.retryable and time.monotonic() - t0 < 5


def test_the_sync_client_is_usable_from_several_threads(far):
    errors: list[BaseException] = []
    with Client(far.addresses["router"], timeout=10) as client:
        def work(i: int) -> None:
            try:
                for _ in range(20):
                    [seq] = client.generate([i, 1], n=1)
                    assert seq.token_ids == [7]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors
    with pytest.raises(ClientError, match="closed"):
        client.stats()


def test_pipeline_refuses_work_before_connect():
    pipeline = Pipeline("ipc:///nonexistent", identity=b"x")
    with pytest.raises(ClientError, match="not open"):
        run(pipeline.call("engine", protocol.GetStats(qid=""), timeout=1))
    run(pipeline.close())


def test_a_blocking_call_interrupted_while_waiting_aborts_its_request(far):
    far.script = lambda stage, m: [] if isinstance(m, protocol.Submit) else answer(stage, m)

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)  # (SIGALRM is pytest-timeout's)
    try:
        with Client(far.addresses["router"], timeout=30) as client:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            with pytest.raises(Interrupted):
                client.generate([1, 2, 3])
            rid = far.next(protocol.Submit).rid
            assert far.next(protocol.Abort).rids == [rid]
            assert client.stats().running == 3  # the client goes on working
    finally:
        signal.signal(signal.SIGUSR1, previous)
