"""The detokenizer stage: engine steps in, per-client outputs out, rollouts published.

It learns each request from the engine's Track (sent on the same socket ahead of the
request's outputs), turns every step's deltas into text with stop-string hold-back, sends
each client one Outputs message per step, tells the engine to abort samples whose stop string
matched, and publishes every finished sample on the rollout PUB (never blocking on a slow
subscriber: what would block is dropped and counted). When the engine dies, every request it
held ends here with a retryable error.

A client that goes away (its DEALER disconnects: a raw client that exits, an ingress that
restarted) is noticed through ZMQ_ROUTER_MANDATORY: the next send to it fails with
EHOSTUNREACH, and every request of that client is aborted in the engine, freeing its KV. A
message that cannot be handled is logged and dropped; the stage goes on.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
import msgspec
import zmq

from parallm import protocol
from parallm.config import Config
from parallm.logs import request_extra
from parallm.routing import RecentIds, replica_count
from parallm.runtime import StageRuntime
from parallm.text.sequence import DetokState
from parallm.text.vocab import TokenizerView
from parallm.stages.skeleton import Handler, Stage, text_tokenizer
from parallm.transport import Receiver, Router, Sender, open_socket

log = logging.getLogger("parallm.detokenizer")


@dataclass
class _Request:
    reply_to: bytes
    states: list[DetokState]
    remaining: int
    replica: int = 0  # the engine replica that holds it (Track.replica)
    pooling: bool = False  # RequestSpec.pooling: a vector, not a rollout


class DetokenizerStage(Stage):
    log = log

    def __init__(self, config: Config, runtime: StageRuntime, tokenizer: TokenizerView, model_name: str) -> None:
        super().__init__(config, runtime)
        self.tok = tokenizer
        self.model_name = model_name
        ctx, addrs, hwm = runtime.ctx, runtime.addrs, config.transport.hwm
        self.inbox = Receiver(open_socket(ctx, zmq.PULL, addrs.detok, bind=True, hwm=hwm),
                              protocol.DetokInbound, name="detokenizer")
        self.router = Router(open_socket(ctx, zmq.ROUTER, addrs.router, bind=True, hwm=hwm),
                             mandatory=True, on_unreachable=self.on_client_gone)
        self.rollouts = open_socket(ctx, zmq.XPUB, addrs.rollouts, bind=True, hwm=config.detokenizer.rollout_hwm)
        self.rollouts.setsockopt(zmq.XPUB_NODROP, 1)
        self.to_engine = Sender(open_socket(ctx, zmq.PUSH, addrs.engine, bind=False, hwm=hwm))
        self.requests: dict[str, _Request] = {}
        self.finished = RecentIds()  # requests that ended lately (parallm/routing.py)
        self.counts = protocol.DetokenizerStats()  # the counters; stats() adds the gauges
        self.last_batch_size = 0
        self.listen(self.inbox, {protocol.StepOutputs: self.on_step, protocol.Track: self.on_track,
                                 protocol.RequestError: self.on_error, **dict.fromkeys(protocol.REPLIES, self.forward)},
                    limit=1024)
        self.clients: dict[type, Handler] = {protocol.Hello: self.on_hello, protocol.GetStats: self.on_stats_query}
        self.listen(self.router, self.clients, limit=256)
        self.watch(self.rollouts, self.on_subscription)
        self.control[protocol.StageDown] = self.on_stage_down

    # ------------------------------------------------------------------ inbound
    def on_track(self, track: protocol.Track) -> None:
        n = track.spec.n
        self.requests[track.rid] = _Request(track.reply_to, [DetokState.from_track(self.tok, track, i) for i in range(n)],
                                            n, track.replica, track.spec.pooling is not None)

    def on_step(self, step: protocol.StepOutputs) -> None:
        now = time.time()
        by_client: dict[bytes, list[protocol.Output]] = defaultdict(list)
        aborts: list[tuple[str, int]] = []
        self.last_batch_size = step.batch_size
        for delta in step.outputs:
            request = self.requests.get(delta.rid)
            if request is None or delta.index >= len(request.states):
                continue
            state = request.states[delta.index]
            out = state.update(delta, now)
            if out is None:
                continue
            by_client[request.reply_to].append(out)
            if state.needs_abort:
                state.needs_abort = False
                aborts.append((delta.rid, delta.index))
            if state.finished:
                if not request.pooling:
                    self.publish(state)
                request.remaining -= 1
                if request.remaining == 0:
                    del self.requests[delta.rid]
                    self.finished.add(delta.rid)
        for reply_to, items in by_client.items():
            self.router.send(reply_to, protocol.Outputs(items=items, batch_size=step.batch_size))
        if aborts:
            self.to_engine.send(protocol.Abort(sequences=aborts, reason="stop"))
            self.counts.stop_string_aborts += len(aborts)
        self.counts.outputs += len(step.outputs)

    def on_error(self, error: protocol.RequestError) -> None:
        if error.rid in self.finished and error.rid not in self.requests:
            return  # a tokenizer's "sent to a replica that died" for a request that had finished
        log.info("%d %s: %s", error.status, error.code, error.message, extra=request_extra(error.rid))
        request = self.requests.pop(error.rid, None)
        reply_to = error.reply_to or (request.reply_to if request else b"")
        if reply_to:
            self.router.send(reply_to, error)
        self.counts.errors += 1

    def publish(self, state: DetokState) -> None:
        rollout = state.rollout()
        try:
            self.rollouts.send_multipart([rollout.adapter.encode(), protocol.encode(rollout)], zmq.NOBLOCK)
            self.counts.rollouts_published += 1
        except zmq.Again:
            self.counts.rollouts_dropped += 1

    def forward(self, reply: protocol.Reply) -> None:
        """A stage's answer to a control request, to the client that asked."""
        if reply.reply_to:
            self.router.send(reply.reply_to, reply)

    def answer(self, message: protocol.Message) -> None:
        """An error for a message the stage could not handle goes straight to its client."""
        address = protocol.reply_address(message)
        if address is not None:
            self.router.send(address[1], message)

    def on_hello(self, identity: bytes, message: protocol.Hello) -> None:
        self.router.send(identity, protocol.Welcome(model=self.model_name, addresses={
            **self.rt.addrs.public(), "engine_replicas": str(replica_count(self.config.engine))}))

    def on_stats_query(self, identity: bytes, message: protocol.GetStats) -> None:
        self.router.send(identity, protocol.StatsReply(qid=message.qid, stats=self.stats()))

    def on_subscription(self) -> None:
        while self.rollouts.poll(0, zmq.POLLIN):
            self.rollouts.recv()  # subscription notices

    def on_client_gone(self, identity: bytes) -> None:
        """`identity` has no connection any more: abort its requests so the engine frees their KV."""
        rids = [rid for rid, request in self.requests.items() if request.reply_to == identity]
        for rid in rids:
            del self.requests[rid]
        if rids:
            self.to_engine.send(protocol.Abort(rids=rids, reason="abort"), block=False)
            self.counts.client_gone_aborts += len(rids)
            for rid in rids:
                log.info("client %r went away: aborted", identity[:32], extra=request_extra(rid))

    def on_stage_down(self, message: protocol.StageDown) -> None:
        """An engine replica died: every request it held is lost; tell each client, retryably. (What a
        tokenizer had sent it and it had not admitted yet, the tokenizer fails: parallm/routing.py.)"""
        if message.stage != "engine":
            return
        replica = message.replica
        lost = [rid for rid, request in self.requests.items() if request.replica == replica]
        for rid in lost:
            request = self.requests.pop(rid)
            self.router.send(request.reply_to, protocol.RequestError(
                rid=rid, status=503, code="stage_restarted", retryable=True,
                message="the engine restarted while this request was in flight; retry it"))
        log.warning("engine replica %d down: failed %d in-flight request(s)", replica, len(lost))

    def stats(self) -> protocol.DetokenizerStats:
        return msgspec.structs.replace(self.counts, in_flight=len(self.requests), unroutable=self.router.unroutable,
                                       unreachable=self.router.unreachable, dropped_frames=self.inbox.dropped,
                                       batch_size=self.last_batch_size, failed_messages=self.failed)

    def in_flight(self) -> int:
        return len(self.requests)


def main(config: Config, replica: int = 0) -> int:
    runtime = StageRuntime(config, "detokenizer", replica)
    if (loaded := text_tokenizer(config, runtime)) is None:
        return 2
    return DetokenizerStage(config, runtime, TokenizerView.of(loaded[0]), config.model.served_name).serve()
