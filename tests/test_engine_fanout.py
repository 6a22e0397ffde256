"""stages/engine_fanout.py over real ZeroMQ sockets: replica 0 answers a control message only once every other
replica has acted on it, and a replica's refusal reaches the client."""

from __future__ import annotations

import itertools

import pytest
import zmq

from parallm import protocol
from parallm.stages.engine_fanout import ANSWER_TIMEOUT_S, VIA_FIRST, Gathering, PeerAnswers
from parallm.transport import Sender

_names = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Pipe:
    """A PUSH Sender and the PULL socket it reaches (inproc)."""

    def __init__(self, ctx: zmq.Context) -> None:
        address = f"inproc://fanout-{next(_names)}"
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(address)
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        self.sender = Sender(push)

    def take(self, timeout_ms: int = 200) -> list[protocol.Message]:
        got = []
        while self.pull.poll(timeout_ms):
            got.append(protocol.decode(self.pull.recv()))
            timeout_ms = 20
        return got


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def publish(qid: str = "q1") -> protocol.AdapterPublish:
    return protocol.AdapterPublish(name="dp", version=2, weights=b"w", qid=qid, reply_to=b"client")


def loaded(qid: str = "q1", reply_to: bytes = b"client") -> protocol.AdapterLoaded:
    return protocol.AdapterLoaded(qid=qid, reply_to=reply_to, name="dp", version=2, bytes=1, load_ms=1.0)


def test_replica_0_answers_once_every_replica_has_loaded(ctx):
    detok, peer1, peer2 = Pipe(ctx), Pipe(ctx), Pipe(ctx)
    gathering = Gathering(detok.sender, [peer1.sender, peer2.sender], lambda replica: False)
    gathering.fan_out(publish())
    for peer in (peer1, peer2):  # each replica gets the version, to answer replica 0
        (copy,) = peer.take()
        assert isinstance(copy, protocol.AdapterPublish) and copy.qid == "q1" and copy.reply_to == VIA_FIRST
        assert copy.weights == b"w" and copy.version == 2
    gathering.send(loaded())
    assert detok.take() == []  # replica 0 loaded it; replicas 1 and 2 have not said so yet
    gathering.receive(protocol.ReplicaAnswer(replica=2, qid="q1"))
    assert detok.take() == []
    gathering.receive(protocol.ReplicaAnswer(replica=1, qid="q1"))
    (answer,) = detok.take()
    assert answer == loaded() and not gathering.pending


def test_the_other_replicas_may_answer_before_replica_0(ctx):
    detok, peer = Pipe(ctx), Pipe(ctx)
    gathering = Gathering(detok.sender, [peer.sender], lambda replica: False)
    gathering.fan_out(publish())
    gathering.receive(protocol.ReplicaAnswer(replica=1, qid="q1"))
    assert detok.take() == []  # replica 0's own load (a read on its reader thread) is still under way
    gathering.send(loaded())
    assert detok.take() == [loaded()]


def test_a_replica_that_refuses_makes_the_client_hear_which_and_why(ctx):
    detok, peer = Pipe(ctx), Pipe(ctx)
    gathering = Gathering(detok.sender, [peer.sender], lambda replica: False)
    gathering.fan_out(publish())
    gathering.receive(protocol.ReplicaAnswer(replica=1, qid="q1", status=400, code="invalid_adapter",
                                             message="lora rank 9 exceeds adapters.max_rank"))
    gathering.send(loaded())
    (error,) = detok.take()
    assert isinstance(error, protocol.RequestError)
    assert (error.rid, error.reply_to, error.status, error.code) == ("q1", b"client", 400, "invalid_adapter")
    assert "replica 1" in error.message and "exceeds adapters.max_rank" in error.message


def test_replica_0s_own_refusal_is_answered_as_it_is(ctx):
    detok, peer = Pipe(ctx), Pipe(ctx)
    gathering = Gathering(detok.sender, [peer.sender], lambda replica: False)
    gathering.fan_out(publish())
    own = protocol.RequestError(rid="q1", reply_to=b"client", status=403, code="adapter_path_not_allowed",
                                message="no")
    gathering.send(own)
    gathering.receive(protocol.ReplicaAnswer(replica=1, qid="q1", status=403, code="adapter_path_not_allowed"))
    assert detok.take() == [own]


def test_a_silent_replica_is_not_waited_for_and_a_mute_one_only_until_the_timeout(ctx):
    detok, peer1, peer2 = Pipe(ctx), Pipe(ctx), Pipe(ctx)
    clock = Clock()
    gathering = Gathering(detok.sender, [peer1.sender, peer2.sender], lambda replica: replica == 2, clock=clock)
    gathering.fan_out(publish())
    assert gathering.pending["q1"].waiting == {1}  # replica 2 stopped reporting: down or restarting
    gathering.send(loaded())
    clock.t = ANSWER_TIMEOUT_S - 1
    gathering.expire()
    assert detok.take() == []
    clock.t = ANSWER_TIMEOUT_S
    gathering.expire()
    assert detok.take() == [loaded()] and not gathering.pending
    gathering.receive(protocol.ReplicaAnswer(replica=1, qid="q1"))  # late: nothing more goes out
    assert detok.take() == []


def test_messages_nobody_waits_for_pass_straight_through(ctx):
    detok, peer = Pipe(ctx), Pipe(ctx)
    gathering = Gathering(detok.sender, [peer.sender], lambda replica: False)
    gathering.fan_out(publish(qid=""))  # a trainer's version on the PUB socket: no reply owed
    (copy,) = peer.take()
    assert copy.qid == "" and copy.reply_to == b"" and not gathering.pending
    abort = protocol.Abort(rids=["r1"])
    gathering.fan_out(abort)
    assert peer.take() == [abort]
    error = protocol.RequestError(rid="r7", reply_to=b"client", status=409, code="aborted")
    gathering.send(error)  # a request's error, not an answer anyone gathers
    assert detok.take() == [error]


def test_another_replica_sends_its_answers_to_handed_on_copies_back_to_replica_0(ctx):
    detok, first = Pipe(ctx), Pipe(ctx)
    answers = PeerAnswers(detok.sender, first.sender, replica=3)
    answers.send(loaded(reply_to=VIA_FIRST))
    answers.send(protocol.RequestError(rid="q2", reply_to=VIA_FIRST, status=400, code="invalid_adapter",
                                       message="bad rank"))
    assert first.take() == [protocol.ReplicaAnswer(replica=3, qid="q1"),
                            protocol.ReplicaAnswer(replica=3, qid="q2", status=400, code="invalid_adapter",
                                                   message="bad rank")]
    mine = loaded(reply_to=b"client")  # an answer to a client that asked this replica itself
    answers.send(mine)
    assert detok.take() == [mine] and first.take() == []
