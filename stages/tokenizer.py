"""A tokenizer stage: chat templates, tokenization and prompt-length checks.

Several replicas may run; producers PUSH to all of them (ZeroMQ round-robins). A request the
templater refuses (too long, bad message) gets its error routed to the client through the
detokenizer, like every other reply; everything else goes on to the engine as a Submit.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable

import msgspec
import zmq

from parallm import protocol, routing
from parallm.config import Config, generates
from parallm.config.schema import BLOCK_SIZE
from parallm.config.pooling import no_generator
from parallm.logs import request_extra
from parallm.routing import Router
from parallm.runtime import StageRuntime
from parallm.text.templating import Templater, TemplateError
from parallm.stages.skeleton import Stage, text_tokenizer
from parallm.stages.tokenizer_offload import LARGE_TEXT_CHARS, Offload, text_chars
from parallm.transport import Receiver, Sender, open_socket
from parallm.vision.fetch import ImageError, ImageLimits
from parallm.vision.inputs import ImageInputs, load_vision_inputs, request_images

log = logging.getLogger("parallm.tokenizer")


class TokenizerStage(Stage):
    log = log

    def __init__(self, config: Config, runtime: StageRuntime, templater: Templater,
                 poolers: dict[str, Templater] | None = None, images: ImageInputs | None = None) -> None:
        super().__init__(config, runtime)
        self.templater = templater
        self.images = images  # a vision-language model's image processor and limits (parallm/vision)
        self.poolers = poolers or {}  # model.pooling's models, each with its own tokenizer and length
        ctx, addrs, hwm = runtime.ctx, runtime.addrs, config.transport.hwm
        self.to_detok = Sender(open_socket(ctx, zmq.PUSH, addrs.detok, bind=False, hwm=hwm))
        # one PUSH per engine replica; Router picks one per request (load, prefix affinity)
        replicas = routing.replica_count(config.engine)  # remote ones take nothing until the supervisor hears them
        self.to_engines = [Sender(open_socket(ctx, zmq.PUSH, routing.engine_address(addrs, i, config.engine),
                                              bind=False, hwm=hwm, curve=routing.replica_curve(config, i)))
                           for i in range(replicas)]
        self.to_engine = self.to_engines[0]
        # the router hashes prompts in blocks of its own: the engines' size, or the GPU default where the engines
        # decide it by their device (the affinity only needs every tokenizer to hash alike)
        self.router = Router(replicas, config.engine.block_size or BLOCK_SIZE, down=range(config.engine.replicas, replicas),
                             tokenizers=config.tokenizer.replicas)
        self.rejected = 0
        self.offload = Offload(on_done=self.waker.wake)  # large tokenizations, on a worker thread
        self.inbox = Receiver(open_socket(ctx, zmq.PULL, addrs.tokenizers[runtime.replica], bind=True, hwm=hwm),
                              protocol.TokenizerInbound, name="tokenizer",
                              on_rejected=lambda error: self.to_detok.send(error, block=False))
        self.listen(self.inbox, {
            protocol.TextSubmit: self.on_text_submit,
            protocol.Tokenize: lambda m: self._answer(m, lambda: protocol.TokenizeReply(
                qid=m.qid, reply_to=m.reply_to, ids=protocol.pack_ids(self.templater.tokenize(m))),
                large=text_chars([m.prompt, m.messages]) > LARGE_TEXT_CHARS),
            protocol.Detokenize: lambda m: self._answer(m, lambda: protocol.DetokenizeReply(
                qid=m.qid, reply_to=m.reply_to, text=self.templater.detokenize(m))),
            protocol.GetStats: lambda m: self.answer(protocol.StatsReply(qid=m.qid, reply_to=m.reply_to,
                                                                         stats=self.stats())),
        }, limit=256)
        self.control[protocol.StageDown] = self.on_stage_down  # a replica down takes no request until it is back
        self.control[protocol.StageUp] = self.on_stage_up

    def answer(self, message: protocol.Message) -> None:
        """Replies and errors go to the detokenizer, which routes them to the client."""
        self.to_detok.send(message)

    def _answer(self, request: Any, compute: Callable[[], protocol.Reply], large: bool = False) -> None:
        """Send the reply `compute` builds for a control request, or the template error as its RequestError;
        a `large` one is computed on the worker thread (stages/tokenizer_offload.py)."""
        if large:
            self.offload.submit(compute, lambda done: self.safely(lambda m: self._answer(m, done.result), request))
            return
        try:
            reply = compute()
        except TemplateError as exc:
            self.to_detok.send(exc.to_error(request.qid, request.reply_to))
            return
        self.to_detok.send(reply)

    def work(self) -> bool:
        """Send what the worker thread finished (a large request's ids or its error)."""
        return self.offload.finish() > 0 if self.offload else False

    def idle_wait_ms(self) -> int:
        return min(self.beat_ms, 5) if self.offload else self.beat_ms  # large work running (the worker wakes the poll too)

    def in_flight(self) -> int:
        return len(self.offload)

    def encode(self, message: protocol.TextSubmit) -> list[int]:
        return self.templater_for(message.spec).encode(message)

    def templater_for(self, spec: protocol.RequestSpec) -> Templater:
        """The generator's templater, or a pooling request's model's. A server whose model.path is a pooling
        model has no generator (its own tokenizer still answers Tokenize and Detokenize)."""
        if spec.pooling is None:
            if not generates(self.config):
                model = self.config.model
                raise TemplateError(f"{no_generator(model.served_name, model.task)}; it serves pooling requests only "
                                    "(embeddings, rewards, classifications)", "model", code="model_not_generative")
            return self.templater
        templater = self.poolers.get(spec.pooling.model)
        if templater is None:
            raise TemplateError(f"pooling model '{spec.pooling.model}' is not served (served: "
                                f"{', '.join(sorted(self.poolers)) or 'none'})", "model", status=404,
                                code="model_not_found")
        return templater

    def on_text_submit(self, message: protocol.TextSubmit) -> None:
        if message.spec.pooling is not None and message.messages is not None:
            # a pooling model scores the conversation as it stands: no generation prompt, and the template
            # writes the special tokens itself
            message = msgspec.structs.replace(message, add_generation_prompt=False, add_special_tokens=False)
        encode = partial(self.encode, message)
        if text_chars([message.prompt, message.messages]) > LARGE_TEXT_CHARS:
            self.offload.submit(encode, lambda done: self.safely(lambda m: self._submit(m, done.result), message))
            return
        self._submit(message, encode)

    def _submit(self, message: protocol.TextSubmit, encode: Callable[[], list[int]]) -> None:
        """Send the request on to an engine with the ids `encode` gives, or refuse it with the template error."""
        try:
            ids = encode()
            images = self.prepare_images(message, ids, self.templater_for(message.spec))
        except TemplateError as exc:
            self.rejected += 1
            log.info("refused: %s", exc.message, extra=request_extra(message.rid, status=exc.status, param=exc.param))
            self.to_detok.send(exc.to_error(message.rid, message.reply_to))
            return
        spec = message.spec
        replica = self.router.choose(ids, cost=len(ids) + (spec.params.max_tokens or 0) * spec.n, adapter=spec.adapter,
                                     rid=message.rid, reply_to=message.reply_to) if len(self.to_engines) > 1 else 0
        self.to_engines[replica].send(protocol.Submit(rid=message.rid, reply_to=message.reply_to,
                                                      prompt_ids=protocol.pack_ids(ids), spec=spec, images=images))

    def prepare_images(self, message: protocol.TextSubmit, ids: list[int], templater: Templater) -> list[protocol.Tensor]:
        """The request's images as pixel tensors, fetched, decoded and processed here (`ids` expanded in place
        to the image-token runs they fill); a bad image is a TemplateError naming its part."""
        prompt_param = "messages" if message.messages is not None else "prompt"
        try:
            parts = request_images(message)
            if not parts:
                return []
            if self.images is None or templater is not self.templater:
                raise ImageError(f"{parts[0][0]}: {templater.text_only}", parts[0][0])
            expanded, tensors = self.images.prepare(ids, parts, prompt_param)
        except ImageError as exc:
            raise TemplateError(exc.message, exc.param, status=exc.status) from None
        templater.check_length(len(expanded), message.spec.params.max_tokens, prompt_param)
        ids[:] = expanded
        return tensors

    def on_stage_down(self, message: protocol.StageDown) -> None:
        if message.stage == "engine":
            for rid, reply_to in self.router.mark_down(message.replica):  # sent to it lately: maybe lost
                self.to_detok.send(routing.lost_error(rid, reply_to))

    def on_stage_up(self, message: protocol.StageUp) -> None:
        if message.stage == "engine":
            self.router.mark_up(message.replica)

    def stats(self) -> protocol.TokenizerStats:
        return protocol.TokenizerStats(handled=self.handled, rejected=self.rejected, failed=self.failed,
                                       dropped_frames=self.inbox.dropped, routed=list(self.router.routed),
                                       affinity_hits=self.router.affinity_hits,
                                       home_hits=self.router.home_hits, down=sorted(self.router.down))


def main(config: Config, replica: int = 0) -> int:
    runtime = StageRuntime(config, "tokenizer", replica)
    if (loaded := text_tokenizer(config, runtime)) is None:
        return 2
    tokenizer, limits = loaded
    templater = Templater(tokenizer, limits["max_model_len"], limits["vocab_size"] or None)
    try:
        images = load_vision_inputs(config.model.path, templater, ImageLimits.of(config.tokenizer))
    except (OSError, ValueError, ImportError) as exc:
        runtime.fatal(f"cannot load the image processor of {config.model.path!r}: {exc}")
        return 2
    from parallm.text.loading import load_pooling_templaters

    try:
        poolers = {name: Templater(tok, info.max_len, info.vocab_size or None) for name, (tok, info)
                   in load_pooling_templaters(config.model.pooling, config.model.trust_remote_code).items()}
    except (OSError, ValueError) as exc:
        runtime.fatal(f"cannot load the tokenizers of model.pooling: {exc}")
        return 2
    return TokenizerStage(config, runtime, templater, poolers, images).serve(limits)
