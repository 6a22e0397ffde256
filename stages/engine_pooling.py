"""The engine stage's pooling work, and the engine stage of a server with no generator.

`PooledOut` is what any engine stage does for model.pooling's requests: queue one (a Track to the
detokenizer first, as for generation), answer a batched pass's vectors as each request's one and last
output, end aborted ones. `PoolingOnlyStage` is the engine stage when model.path is a pooling model
(model.task embed, reward or classify): the same sockets at the same addresses and the same messages
as the engine stage, so the tokenizers, the detokenizer, ingress and raw clients work unchanged, but
the pooling queue is all it runs. Every generation message (a Submit without RequestSpec.pooling, a
Score, adapter and weight updates, a prefix-cache reset) is refused with a 400 that names why.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import zmq

from parallm import protocol, routing
from parallm.config import Config
from parallm.config.pooling import no_generator
from parallm.engine.pooling_queue import Pooled, PoolingQueue
from parallm.engine.request import RequestRejected
from parallm.runtime import StageRuntime
from parallm.stages.engine_replies import rejection
from parallm.stages.skeleton import Stage
from parallm.transport import Receiver, Sender, open_socket

log = logging.getLogger("parallm.engine.stage")


class PooledOut:
    """model.pooling's requests of one engine stage: queued, and their outputs sent to the detokenizer."""

    def __init__(self, queue: PoolingQueue, out: Sender, replica: int) -> None:
        self.queue, self.out, self.replica = queue, out, replica

    def submit(self, message: protocol.Submit) -> None:
        """Queue a pooling request (prefill-only work); `send` answers it once a pass computed it."""
        spec = message.spec
        assert spec.pooling is not None
        try:
            self.queue.add(message.rid, protocol.unpack_ids(message.prompt_ids), spec.pooling, priority=spec.priority)
        except RequestRejected as exc:
            self.out.send(rejection(message.rid, message.reply_to, exc))
            return
        self.out.send(protocol.Track(rid=message.rid, reply_to=message.reply_to, prompt_ids=message.prompt_ids,
                                     spec=spec, replica=self.replica))

    def send(self, done: list[Pooled], step: int) -> None:
        """A pooling pass's results: each request's vector (float32) and its usage, as its one and last output."""
        if done:
            self.out.send(protocol.StepOutputs(step=step, time=time.time(), batch_size=len(done), outputs=[
                protocol.SeqDelta(rid=p.rid, pooled=protocol.pack_floats(p.vector), finish_reason="stop",
                                  usage=protocol.Usage(prompt_tokens=p.prompt_tokens, completion_tokens=0))
                for p in done]))

    def abort(self, rids: Sequence[str], step: int) -> None:
        """Aborted pooling requests that were still waiting end with finish_reason 'abort' and no vector."""
        ended = [protocol.SeqDelta(rid=rid, finish_reason="abort") for rid in list(rids) if self.queue.abort(rid)]
        if ended:
            self.out.send(protocol.StepOutputs(step=step, time=time.time(), batch_size=0, outputs=ended))

    def count(self, stats: protocol.EngineStats) -> None:
        """The queue's counters and gauge in the engine's stats (its waiting requests count as waiting)."""
        queue = self.queue
        stats.pooled_requests, stats.pooled_tokens, stats.pooling_batches = queue.requests, queue.tokens, queue.batches
        stats.pooling_waiting = len(queue)
        stats.waiting += len(queue)


class PoolingOnlyStage(Stage):
    """The engine stage of a pooling-only server (see the module)."""

    log = log

    def __init__(self, config: Config, runtime: StageRuntime, queue: PoolingQueue, model_info: dict[str, Any]) -> None:
        super().__init__(config, runtime)
        ctx, hwm = runtime.ctx, config.transport.hwm
        self.out = Sender(open_socket(ctx, zmq.PUSH, runtime.addrs.detok, bind=False, hwm=hwm))
        self.inbox = Receiver(open_socket(ctx, zmq.PULL, routing.engine_address(runtime.addrs, 0, config.engine),
                                          bind=True, hwm=hwm), protocol.EngineInbound, name="engine",
                              on_rejected=self.answer)
        sub = open_socket(ctx, zmq.SUB, routing.adapters_address(runtime.addrs, 0, config.engine), bind=True, hwm=hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # bound as the engine's is: publishers connect, and are told no
        self.adapter_sub = Receiver(sub, protocol.EngineInbound, name="adapters", on_rejected=self.answer)
        self.pooling = PooledOut(queue, self.out, runtime.replica)
        self.model_info = model_info
        self.why = no_generator(config.model.served_name, config.model.task)
        self.paused = False
        self.step_count = 0
        refuse = self.refuse
        handlers = {
            protocol.Submit: self.on_submit, protocol.Abort: self.on_abort, protocol.Score: refuse,
            protocol.GetStats: lambda m: self.answer(protocol.StatsReply(qid=m.qid, reply_to=m.reply_to,
                                                                         stats=self.stats())),
            protocol.AdapterPublish: refuse, protocol.AdapterUnload: refuse, protocol.WeightsUpdate: refuse,
            protocol.ResetPrefixCache: refuse, protocol.ReplicaStats: lambda m: None,
            protocol.ReplicaAnswer: lambda m: None,
            protocol.TrainingPhase: lambda m: None,  # no generator to rest (and no trainer can train here)
            protocol.ListAdapters: lambda m: self.answer(protocol.AdapterList(qid=m.qid, reply_to=m.reply_to)),
            protocol.Pause: self.on_pause, protocol.Resume: self.on_resume}
        self.listen(self.adapter_sub, handlers)
        self.listen(self.inbox, handlers)

    def answer(self, message: protocol.Message) -> None:
        """Replies and errors go to the detokenizer, which routes them to their client."""
        self.out.send(message, block=False)

    def refuse(self, message: Any) -> None:
        """A message only a generator can act on: a 400 to whoever asked (nothing for a trainer's publish
        on the PUB socket, which names no one; it is logged)."""
        rid, reply_to = getattr(message, "qid", "") or getattr(message, "rid", ""), message.reply_to
        what = type(message).__name__
        if not reply_to:
            log.warning("%s dropped: %s", what, self.why)
            return
        self.answer(protocol.RequestError(rid=rid, reply_to=reply_to, status=400, code="model_not_generative",
                                          param="model", message=f"{what}: {self.why}; it serves pooling "
                                          f"requests only (embeddings, rewards, classifications)"))

    def on_submit(self, message: protocol.Submit) -> None:
        if message.spec.pooling is None:
            self.refuse(message)
        else:
            self.pooling.submit(message)

    def on_abort(self, message: protocol.Abort) -> None:
        self.pooling.abort(self.pooling.queue.rids() if message.all else message.rids, self.step_count)

    def on_pause(self, message: protocol.Pause) -> None:
        self.paused = True
        if message.mode == "abort":
            self.pooling.abort(self.pooling.queue.rids(), self.step_count)
        self.answer(protocol.PauseState(qid=message.qid, reply_to=message.reply_to, paused=True, mode=message.mode))

    def on_resume(self, message: protocol.Resume) -> None:
        self.paused = False
        self.answer(protocol.PauseState(qid=message.qid, reply_to=message.reply_to, paused=False))

    def stats(self) -> protocol.EngineStats:
        stats = protocol.EngineStats(steps=self.step_count, paused=self.paused, received=self.handled,
                                     dropped_frames=self.inbox.dropped + self.adapter_sub.dropped,
                                     loop=self.loop_stats())
        self.pooling.count(stats)
        return stats

    def in_flight(self) -> int:
        return len(self.pooling.queue)

    def work(self) -> bool:
        """One batched pooling pass over the best waiting requests, and its vectors out."""
        if self.paused or not self.pooling.queue:
            return False
        t0 = time.perf_counter()
        self.step_count += 1
        try:
            done = self.pooling.queue.step()
        except Exception as exc:  # noqa: BLE001 - e.g. MLX out of memory: fail fast, get restarted
            rids = self.pooling.queue.rids()
            log.exception("pooling pass failed; failing %d request(s) and exiting for a restart", len(rids))
            for rid in rids:
                self.answer(protocol.RequestError(rid=rid, reply_to=b"", status=503, code="engine_error",
                                                  retryable=True, message=f"the engine failed ({type(exc).__name__}) "
                                                  "while this request was in flight; retry it"))
            time.sleep(0.3)  # sockets close with LINGER 0: let the errors leave first
            self.stop(1)
            return False
        t1 = time.perf_counter()
        self.pooling.send(done, self.step_count)
        self.loop_time["step_s"] += t1 - t0
        self.loop_time["send_s"] += time.perf_counter() - t1
        return True


def main(config: Config, runtime: StageRuntime) -> int:
    """The engine stage of a pooling-only server: model.pooling's models loaded (model.path's first)."""
    from parallm.models import ModelLoadError
    from parallm.pooling.load import load_entry

    try:
        models = {m.info.name: m for m in (load_entry(e, config.model.cache_dir) for e in config.model.pooling)}
    except (ModelLoadError, ValueError) as exc:
        runtime.fatal(f"cannot load the pooling models of model.pooling: {exc}")
        return 2
    info = models[config.model.served_name].info
    model_info = {"model": info.name, "path": config.model.path, "task": info.task, "max_model_len": info.max_len,
                  "vocab_size": info.vocab_size, "pooling": sorted(models)}
    return PoolingOnlyStage(config, runtime, PoolingQueue(models, config.engine.pooling_batch_tokens),
                            model_info).serve(model_info)
