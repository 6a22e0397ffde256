"""A tokenizer stage: chat templates, tokenization and prompt-length checks.

Several replicas may run; producers PUSH to all of them (ZeroMQ round-robins). A request the
templater refuses (too long, bad message) gets its error routed to the client through the
detokenizer, like every other reply; everything else goes on to the engine as a Submit.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import zmq

from parallm import protocol, routing
from parallm.config import Config
from parallm.logs import request_extra
from parallm.routing import Router
from parallm.runtime import StageRuntime
from parallm.text.templating import Templater, TemplateError
from parallm.transport import Receiver, Sender, open_socket

log = logging.getLogger("parallm.tokenizer")


class TokenizerStage:
    def __init__(self, config: Config, runtime: StageRuntime, templater: Templater) -> None:
        self.config = config
        self.rt = runtime
        self.templater = templater
        ctx, addrs, hwm = runtime.ctx, runtime.addrs, config.transport.hwm
        self.inbox = Receiver(open_socket(ctx, zmq.PULL, addrs.tokenizers[runtime.replica], bind=True, hwm=hwm),
                              protocol.TokenizerInbound, name="tokenizer",
                              on_rejected=lambda error: self.to_detok.send(error, block=False))
        # one PUSH per engine replica; Router picks one per request (load, prefix affinity)
        replicas = routing.replica_count(config.engine)  # remote ones take nothing until the supervisor hears them
        self.to_engines = [Sender(open_socket(ctx, zmq.PUSH, routing.engine_address(addrs, i, config.engine),
                                              bind=False, hwm=hwm, curve=routing.replica_curve(config, i)))
                           for i in range(replicas)]
        self.to_engine = self.to_engines[0]
        self.router = Router(replicas, config.engine.block_size, down=range(config.engine.replicas, replicas))
        self.to_detok = Sender(open_socket(ctx, zmq.PUSH, addrs.detok, bind=False, hwm=hwm))
        self.handled = 0
        self.rejected = 0
        self.failed = 0

    def handle(self, message: Any) -> None:
        self.handled += 1
        if isinstance(message, protocol.TextSubmit):
            self.on_text_submit(message)
        elif isinstance(message, protocol.Tokenize):
            self._answer(message, lambda: protocol.TokenizeReply(
                qid=message.qid, reply_to=message.reply_to, ids=protocol.pack_ids(self.templater.tokenize(message))))
        elif isinstance(message, protocol.Detokenize):
            self._answer(message, lambda: protocol.DetokenizeReply(
                qid=message.qid, reply_to=message.reply_to, text=self.templater.detokenize(message)))
        elif isinstance(message, protocol.GetStats):
            self._answer(message, lambda: protocol.StatsReply(qid=message.qid, reply_to=message.reply_to,
                                                              stats=self.stats()))

    def _answer(self, request: Any, compute: Callable[[], protocol.Reply]) -> None:
        """Send the reply `compute` builds for a control request, or the template error as its RequestError."""
        try:
            reply = compute()
        except TemplateError as exc:
            self.to_detok.send(exc.to_error(request.qid, request.reply_to))
            return
        self.to_detok.send(reply)

    def on_text_submit(self, message: protocol.TextSubmit) -> None:
        try:
            ids = self.templater.encode(message)
        except TemplateError as exc:
            self.rejected += 1
            log.info("refused: %s", exc.message, extra=request_extra(message.rid, status=exc.status, param=exc.param))
            self.to_detok.send(exc.to_error(message.rid, message.reply_to))
            return
        spec = message.spec
        replica = self.router.choose(ids, cost=len(ids) + (spec.params.max_tokens or 0) * spec.n, adapter=spec.adapter,
                                     rid=message.rid, reply_to=message.reply_to) if len(self.to_engines) > 1 else 0
        self.to_engines[replica].send(protocol.Submit(rid=message.rid, reply_to=message.reply_to,
                                                      prompt_ids=protocol.pack_ids(ids), spec=spec))

    def safely(self, message: Any) -> None:
        """Handle one message; one that breaks the templater is logged and answered if it can be."""
        try:
            self.handle(message)
        except Exception as exc:  # noqa: BLE001 - a bad message must not take the stage down
            self.failed += 1
            rid = getattr(message, "rid", "") or getattr(message, "qid", "")
            log.exception("could not handle a %s", type(message).__name__, extra=request_extra(rid))
            reply_to = getattr(message, "reply_to", b"")
            if rid and reply_to:
                self.to_detok.send(protocol.RequestError(rid=rid, reply_to=reply_to, status=400, message=(
                    f"the tokenizer could not handle this request ({type(exc).__name__}); the server logged why")))

    def stats(self) -> protocol.TokenizerStats:
        return protocol.TokenizerStats(handled=self.handled, rejected=self.rejected, failed=self.failed,
                                       dropped_frames=self.inbox.dropped, routed=list(self.router.routed),
                                       affinity_hits=self.router.affinity_hits, down=sorted(self.router.down))

    def run(self) -> int:
        beat_ms = max(1, int(self.config.supervisor.heartbeat_s * 1000))
        while not self.rt.shutting_down:
            message = self.inbox.recv(timeout_ms=beat_ms)
            if message is not None:
                self.safely(message)
                for queued in self.inbox.drain(256):
                    self.safely(queued)
            for control in self.rt.poll_control():  # a replica down takes no request until it is back
                if isinstance(control, protocol.StageDown) and control.stage == "engine":
                    for rid, reply_to in self.router.mark_down(control.replica):  # sent to it lately: maybe lost
                        self.to_detok.send(routing.lost_error(rid, reply_to))
                elif isinstance(control, protocol.StageUp) and control.stage == "engine":
                    self.router.mark_up(control.replica)
            self.rt.heartbeat()
        return 0


def main(config: Config, replica: int = 0) -> int:
    runtime = StageRuntime(config, "tokenizer", replica)
    from parallm.text.loading import load_text_tokenizer

    try:
        tokenizer, limits = load_text_tokenizer(config.model)
    except (OSError, ValueError) as exc:
        runtime.fatal(f"cannot load the tokenizer of {config.model.path!r}: {exc}")
        return 2
    templater = Templater(tokenizer, limits["max_model_len"], limits["vocab_size"] or None)
    stage = TokenizerStage(config, runtime, templater)
    runtime.ready(limits)
    try:
        return stage.run()
    finally:
        runtime.close()
