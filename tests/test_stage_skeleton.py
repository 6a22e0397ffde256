"""The stage skeleton (stages/skeleton.py) without a model: dispatch by type, one `safely` that answers at
the address the message's type declares, a handler table that must cover its socket's union, `stop`."""

from __future__ import annotations

import pytest
import zmq

from parallm import protocol
from parallm.config import build_config
from parallm.runtime import StageRuntime
from parallm.stages.skeleton import Stage
from parallm.transport import Receiver, Sender, open_socket


class Echo(Stage):
    """A test stage on a tokenizer's union: Tokenize is answered, TextSubmit and Detokenize break their
    handlers, GetStats stops the loop."""

    def __init__(self, config, runtime: StageRuntime, address: str, *, complete: bool = True) -> None:
        super().__init__(config, runtime)
        self.answers: list[protocol.Message] = []
        inbox = Receiver(open_socket(runtime.ctx, zmq.PULL, address, bind=True), protocol.TokenizerInbound, name="echo")
        handlers = {protocol.TextSubmit: self.broken, protocol.Detokenize: self.broken,
                    protocol.Tokenize: lambda m: self.answer(protocol.TokenizeReply(qid=m.qid, ids=b""))}
        if complete:
            handlers[protocol.GetStats] = lambda m: self.stop(3)
        self.listen(inbox, handlers)

    def answer(self, message: protocol.Message) -> None:
        self.answers.append(message)

    def broken(self, message: protocol.Message) -> None:
        raise ValueError("/a/server/path in the exception's text")


@pytest.fixture
def stage_env(tmp_path):
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)},
                                                 "supervisor": {"heartbeat_s": 0.05}})
    ctx = zmq.Context()
    runtime = StageRuntime(config, "tokenizer", ctx=ctx)
    yield config, runtime, f"ipc://{tmp_path}/echo.sock"
    ctx.destroy(0)


def test_messages_go_to_their_handlers_and_a_broken_one_is_answered_at_its_address(stage_env):
    config, runtime, address = stage_env
    stage = Echo(config, runtime, address)
    to_stage = Sender(open_socket(runtime.ctx, zmq.PUSH, address, bind=False))
    to_stage.send(protocol.TextSubmit(rid="r1", reply_to=b"client", prompt="hi"))  # answered: rid and reply_to
    to_stage.send(protocol.Detokenize(qid="q1", reply_to=b"", ids=b""))  # names no client: nobody to answer
    to_stage.send(protocol.Tokenize(qid="q2", reply_to=b"client", prompt="hi"))
    to_stage.send(protocol.GetStats(qid="q3"))
    assert stage.run() == 3
    error, reply = stage.answers
    assert (error.rid, error.reply_to, error.status) == ("r1", b"client", 400)
    assert "ValueError" in error.message and "/a/server/path" not in error.message
    assert isinstance(reply, protocol.TokenizeReply) and reply.qid == "q2"
    assert (stage.handled, stage.failed) == (4, 2)


def test_a_handler_table_must_cover_its_sockets_union(stage_env):
    config, runtime, address = stage_env
    with pytest.raises(TypeError, match="GetStats"):
        Echo(config, runtime, address, complete=False)


def test_reply_address_is_read_from_the_type():
    assert protocol.reply_address(protocol.Submit(rid="r", reply_to=b"c", prompt_ids=b"")) == ("r", b"c")
    assert protocol.reply_address(protocol.Abort(qid="q", reply_to=b"c")) == ("q", b"c")
    assert protocol.reply_address(protocol.Abort(rids=["r"])) is None  # an abort that asked for no answer
    assert protocol.reply_address(protocol.StepOutputs(step=1, time=0.0, batch_size=0, outputs=[])) is None


class Waiting(Echo):
    """Idle polls of a minute; work() stops the loop once a worker thread's result is there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.result: list[float] = []

    def idle_wait_ms(self) -> int:
        return 60_000

    def work(self) -> bool:
        if self.result:
            self.stop(0)
        return False


def test_a_worker_thread_wakes_the_idle_poll(stage_env):
    """Issue 37: a worker's finished future (`add_done_callback(stage.waker.wake)`) ends the stage's idle poll
    at once, rather than at its next timed poll."""
    import concurrent.futures
    import time

    config, runtime, address = stage_env
    stage = Waiting(config, runtime, address)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        future = pool.submit(lambda: (time.sleep(0.3), stage.result.append(time.monotonic()))[1])
        future.add_done_callback(stage.waker.wake)
        assert stage.run() == 0
    assert time.monotonic() - start < 5.0  # not the minute of the idle poll
    stage.waker.wake()
    stage.waker.wake()
    stage.waker.drain()  # wake-ups pile up harmlessly and drain at once
    for sock in stage._on_ready:
        if isinstance(sock, zmq.Socket):
            sock.close(0)
