"""Engine replica 0 hands control messages on to the other replicas and answers a client only once every
replica has acted on them.

Why: the tokenizer routes a request to any replica, so "adapter version 2 loaded" must mean that every
replica holds version 2. Replica 0 used to answer after its own load while replica 1 was still loading
(its copy was sent without a reply address), and a request pinned to the new version and routed to
replica 1 right after the upload's 200 got 404 "has no version 2" (a CI failure of
tests/e2e/test_parallel.py). Now a copy carries the client's qid and `VIA_FIRST` as its reply address;
the other replica's answer (reply or error) comes back to replica 0 as a ReplicaAnswer (`PeerAnswers`),
and replica 0 holds its own answer until each replica it waits for has answered (`Gathering`).

A replica silent for routing.STALE_AFTER_S (down, restarting: it loses its adapters anyway and is given
them again by publishing again, docs/operations.md) is not waited for; one that does not answer within
ANSWER_TIMEOUT_S is logged and the client gets replica 0's answer. A replica's error wins over replica
0's success: the client learns which replica refused and why."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from parallm import protocol
from parallm.transport import Sender

log = logging.getLogger("parallm.engine.stage")

FANNED_OUT = (protocol.Abort, protocol.AdapterPublish, protocol.AdapterUnload, protocol.Pause, protocol.Resume,
              protocol.WeightsUpdate, protocol.TrainingPhase)
UNANSWERED = (protocol.Abort, protocol.TrainingPhase)  # handed on as they are (no qid, no answer)
VIA_FIRST = b"\x00replica-0"  # a handed-on copy's reply address: its answer goes back to replica 0
ANSWER_TIMEOUT_S = 60.0  # a large adapter read from a slow disk by every replica still answers within it


def _answer_id(message: Any) -> str:
    """The qid an answer belongs to (a RequestError names a control request's qid as its rid)."""
    return message.rid if isinstance(message, protocol.RequestError) else getattr(message, "qid", "")


class PeerAnswers:
    """Replica i > 0's outbound Sender: an answer to a copy replica 0 handed on goes back to replica 0 as a
    ReplicaAnswer; everything else goes to the detokenizer as before."""

    def __init__(self, out: Sender, to_first: Sender, replica: int) -> None:
        self.out, self.to_first, self.replica = out, to_first, replica

    def send(self, message: protocol.Message, *, block: bool = True) -> bool:
        if getattr(message, "reply_to", None) != VIA_FIRST:
            return self.out.send(message, block=block)
        answer = protocol.ReplicaAnswer(replica=self.replica, qid=_answer_id(message))
        if isinstance(message, protocol.RequestError):
            answer.status, answer.code, answer.message = message.status, message.code, message.message
        return self.to_first.send(answer, block=False)  # replica 0 may be down: never wait for it


@dataclass
class _Pending:
    waiting: set[int]
    deadline: float
    own: protocol.Message | None = None
    refusals: list[protocol.ReplicaAnswer] = field(default_factory=list)


class Gathering:
    """Replica 0's outbound Sender and its fan-out: `fan_out` hands a message on to every other replica
    (`peers[i - 1]` is replica i); while the other replicas' answers to it are owed, replica 0's own answer
    to that qid is held (`send`) and sent when the last one arrives (`receive`) or the wait ends
    (`expire`)."""

    def __init__(self, out: Sender, peers: list[Sender], silent: Callable[[int], bool], *,
                 clock: Callable[[], float] = time.monotonic, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        self.out, self.peers, self.silent = out, peers, silent
        self.clock, self.timeout_s = clock, timeout_s
        self.pending: dict[str, _Pending] = {}

    def fan_out(self, message: Any) -> None:
        """Send `message` on to the other replicas; one that has a qid is answered once they have acted."""
        asks = not isinstance(message, UNANSWERED) and bool(message.qid) and bool(message.reply_to)
        copy = message if isinstance(message, UNANSWERED) else msgspec.structs.replace(
            message, qid=message.qid if asks else "", reply_to=VIA_FIRST if asks else b"")
        waiting = set()
        for replica, peer in enumerate(self.peers, start=1):
            if peer.send(copy, block=False) and asks and not self.silent(replica):
                waiting.add(replica)
        if waiting:
            self.pending[message.qid] = _Pending(waiting, self.clock() + self.timeout_s)

    def send(self, message: protocol.Message, *, block: bool = True) -> bool:
        pending = self.pending.get(_answer_id(message)) if self.pending else None
        if pending is None or getattr(message, "reply_to", b"") in (b"", VIA_FIRST):
            return self.out.send(message, block=block)
        pending.own = message
        self._settle(_answer_id(message))
        return True

    def receive(self, answer: protocol.ReplicaAnswer) -> None:
        pending = self.pending.get(answer.qid)
        if pending is None or answer.replica not in pending.waiting:
            return  # late (after the wait ended) or not one this replica waits for
        pending.waiting.discard(answer.replica)
        if answer.status >= 400:
            pending.refusals.append(answer)
        self._settle(answer.qid)

    def expire(self) -> None:
        """Answer what waited ANSWER_TIMEOUT_S for a replica that never answered."""
        now = self.clock()
        for qid, pending in list(self.pending.items()):
            if now >= pending.deadline:
                if pending.own is None:  # replica 0's own answer is not ready either: keep the wait open
                    continue
                log.warning("replicas %s did not answer %s within %g s; answering with replica 0's result",
                            sorted(pending.waiting), type(pending.own).__name__, self.timeout_s)
                pending.waiting.clear()
                self._settle(qid)

    def _settle(self, qid: str) -> None:
        pending = self.pending[qid]
        if pending.own is None or pending.waiting:
            return
        del self.pending[qid]
        own = pending.own
        if pending.refusals and not isinstance(own, protocol.RequestError):
            first = min(pending.refusals, key=lambda a: a.replica)
            own = protocol.RequestError(
                rid=qid, reply_to=own.reply_to, status=first.status, code=first.code,  # type: ignore[attr-defined]
                message=f"engine replica {first.replica} refused it (replica 0 applied it): {first.message}")
        self.out.send(own)
