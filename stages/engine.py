"""The engine stage: the only process that imports the model.

One busy loop: drain the inbox, run one engine step, push that step's outputs (one message for
all rows) to the detokenizer. While idle it blocks on the inbox for up to a heartbeat.
A request the engine refuses gets a RequestError routed to its client; nothing else stops.
Adapter versions arrive on the bound `adapters` SUB socket (trainers' PUBs connect to it) or on
the inbox; each is loaded between two steps, so a version takes effect at a step boundary.
Each engine step runs under a deadline (parallm/engine/step_deadline.py) that the heartbeat carries: an
engine that hangs alive inside a step is restarted by the supervisor once the step outlives it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from typing import Any, Callable

import mlx.core as mx
import zmq

from parallm import blas, protocol, routing
from parallm.adapters import AdapterError, HeldRequests
from parallm.engine.weights import ChunkStaging
from parallm.config import Config, generates
from parallm.engine import Engine, EngineModel, Request, RequestRejected, ScoreResult, SeqOutput, distributed
from parallm.engine.compile_queue import CompileQueue
from parallm.engine.device_share import DeviceShare
from parallm.engine.images import unpack_images
from parallm.engine.pooling_queue import Pooled, PoolingQueue
from parallm.engine.step_deadline import StepDeadline, one_engine_deadline, step_kind_and_work
from parallm.runtime import StageRuntime
from parallm.stages.engine_adapters import (AdapterMessages, adapter_list, adapter_roots, load_adapter,  # noqa: F401
                                             weights_path)  # adapter_roots, load_adapter, weights_path: imported from here
from parallm.stages.engine_pooling import PooledOut, main as pooling_only_main
from parallm.stages.engine_fanout import FANNED_OUT, Gathering, PeerAnswers
from parallm.stages.engine_reads import FileReads
from parallm.stages.engine_replies import rejection, score_reply, to_delta
from parallm.stages.skeleton import Handler, Stage
from parallm.text.grammar import GrammarError
from parallm.transport import Receiver, Sender, open_socket

log = logging.getLogger("parallm.engine.stage")
# the idle integrity check waits this long after the last step, so that a client's next request (a single
# stream's, sent as soon as the last one ended) never waits behind it: the check walks every block of the
# prefix pool in Python (~21 ms of CPU for 142k blocks on this 2-core CPU, the pool of the 10-layer VLM on an
# H200; 90k blocks of the tiny-draft shape here took 34-48 ms at a load average of 10), half of a small
# model's whole 16-token decode there (issue 37). Served 1-token requests back to back on this CPU: 28-75 ms
# -> 4-7 ms (docs/performance.md). Shorter than the 0.3 s between launch.local's engine_stats_after_idle_check reads,
# which rely on it.
IDLE_CHECK_AFTER_S = 0.1


class EngineStage(AdapterMessages, Stage):
    log = log

    def __init__(self, config: Config, runtime: StageRuntime, engine: Engine, model_info: dict[str, Any],
                 pooling: PoolingQueue | None = None, warm_up_s: float = 0.0) -> None:
        """`warm_up_s`: how long the engine's warm-up took (the first step's allowance, step_deadline.py)."""
        super().__init__(config, runtime)
        self.engine = engine
        self.model_info = model_info
        ctx = runtime.ctx
        hwm = config.transport.hwm
        replica = runtime.replica
        to_detokenizer = Sender(open_socket(ctx, zmq.PUSH, runtime.addrs.detok, bind=False, hwm=hwm))
        self.inbox: Receiver = Receiver(open_socket(ctx, zmq.PULL, routing.engine_address(
            runtime.addrs, replica, config.engine), bind=True, hwm=hwm), protocol.EngineInbound, name="engine",
            on_rejected=self.refuse)
        # replica 0 hands aborts, adapter versions and pauses on to the other replicas (parallm/routing.py)
        peers = [Sender(open_socket(ctx, zmq.PUSH, routing.engine_address(runtime.addrs, i, config.engine),
                                    bind=False, hwm=hwm, curve=routing.replica_curve(config, i)))
                 for i in range(1, routing.replica_count(config.engine))] if replica == 0 else []
        to_first = Sender(open_socket(ctx, zmq.PUSH, routing.engine_address(runtime.addrs, 0), bind=False, hwm=hwm)) \
            if replica > 0 else None
        to_supervisor = (Sender(open_socket(ctx, zmq.PUSH, runtime.addrs.supervisor, bind=False))
                         if replica == 0 and config.engine.remote_replicas else None)
        self.reports = routing.ReplicaReports(replica, to_first, to_supervisor=to_supervisor,
                                              remote_from=config.engine.replicas)  # replica i > 0's stats reach 0
        # answers to control messages wait for every replica's (stages/engine_fanout.py)
        self.fanout = Gathering(to_detokenizer, peers, self.reports.silent) if peers else None
        self.out: Sender | Gathering | PeerAnswers = self.fanout or (
            PeerAnswers(to_detokenizer, to_first, replica) if to_first is not None else to_detokenizer)
        # model.pooling's requests
        self.pooling = PooledOut(pooling if pooling is not None else PoolingQueue({}), self.out, replica)
        if replica >= config.engine.replicas:  # a remote replica: the supervisor hears it through its stats
            self.reports.beat_from_thread(lambda: Sender(open_socket(
                ctx, zmq.PUSH, routing.engine_address(runtime.addrs, 0), bind=False, hwm=hwm)))
        sub = open_socket(ctx, zmq.SUB, routing.adapters_address(runtime.addrs, replica, config.engine), bind=True,
                          hwm=hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.adapter_sub: Receiver = Receiver(sub, protocol.EngineInbound, name="adapters", on_rejected=self.refuse)
        self.blas = blas.ThreadGovernor.for_this_process() if mx.default_device() == mx.cpu else None
        self.paused = False
        self.pause_mode = "keep"
        self.staging = ChunkStaging(lambda tensors: self.engine.weights.check_chunk(tensors),  # chunked weight updates
                                    root=config.adapters.weights_staging_dir,
                                    timeout_s=config.adapters.weights_chunk_timeout_s)
        self.reads: FileReads[protocol.AdapterPublish | protocol.WeightsUpdate] = FileReads(
            on_done=self.waker.wake)  # loads by path
        self.held: HeldRequests[protocol.Submit] = HeldRequests(config.adapters)  # waiting for their version
        settings = config.engine
        self.compiling: CompileQueue[protocol.Submit] = CompileQueue(  # waiting for their grammar
            engine.constraints, settings.constraint_timeout_s, settings.max_constraint_bytes, on_done=self.waker.wake)
        self.scores: dict[str, bytes] = {}  # qid -> reply_to of the score requests in the engine
        self.step_count = 0
        self.share = DeviceShare(settings.training_share)  # rests while a trainer's update runs
        self.on_idle: Callable[[], None] = lambda: None  # a tensor-parallel rank 0 tells the others it is idle
        self.integrity_checks = 0    # engine.check_integrity() runs, once each time the engine goes idle
        self.integrity_failures = 0
        self._checked_at_step = 0
        self._last_step_at = 0.0  # perf_counter() at the end of the latest step
        handlers: dict[type, Handler] = {
            protocol.Submit: self.on_submit, protocol.Abort: self.on_abort, protocol.Score: self.on_score,
            protocol.GetStats: lambda m: self.reply(protocol.StatsReply(qid=m.qid, reply_to=m.reply_to,
                                                                        stats=self.stats())),
            protocol.AdapterPublish: self.on_publish, protocol.AdapterUnload: self.on_unload,
            protocol.WeightsUpdate: self.on_weights, protocol.ResetPrefixCache: self.on_reset_prefix_cache,
            protocol.ReplicaStats: self.reports.receive,
            protocol.ReplicaAnswer: self.fanout.receive if self.fanout else lambda m: None,
            protocol.ListAdapters: lambda m: self.reply(adapter_list(self.engine, m.qid, m.reply_to)),
            protocol.Pause: self.on_pause, protocol.Resume: self.on_resume,
            protocol.TrainingPhase: lambda m: self.share.on_phase(m.trainer, m.updating, m.lease_s)}
        if self.fanout:  # replica 0 hands these on to the other replicas before it handles them itself
            handlers.update({kind: self.fanned_out(handlers[kind]) for kind in FANNED_OUT})
        self.listen(self.adapter_sub, handlers)
        self.listen(self.inbox, handlers)
        self.handlers = handlers
        # a message read between a step's passes that is not a Submit: handled right after the step, before the
        # inbox is read again (take_arrivals); a tensor-parallel group's rank 0 (distributed.Leader) reads none
        self.deferred: protocol.Message | None = None
        self.arrivals: Callable[[], None] | None = self.take_arrivals if isinstance(engine, Engine) else None
        # each step's deadline, carried by the heartbeat (a tensor-parallel group's rank 0 gives its own: Leader)
        self.deadline: StepDeadline | None = None
        if isinstance(engine, Engine):
            self.deadline = one_engine_deadline(engine, settings.hang_floor_s, settings.hang_factor, warm_up_s)
            runtime.step_progress = self.deadline.progress

    # ------------------------------------------------------------------ messages
    def fanned_out(self, handler: Handler) -> Handler:
        """`handler`, after sending its message on to every other replica (replica 0 answers once they have)."""
        def fan_out(message: Any) -> None:
            self.fanout.fan_out(message)
            handler(message)
        return fan_out

    def on_reset_prefix_cache(self, message: protocol.ResetPrefixCache) -> None:
        dropped = self.engine.drop_cached_blocks()
        blocks = self.engine.blocks
        self.reply(protocol.PrefixCacheReset(qid=message.qid, reply_to=message.reply_to, dropped=dropped,
                                             held=blocks.num_used if blocks is not None else 0))

    def on_pause(self, message: protocol.Pause) -> None:
        self.paused = True
        self.pause_mode = message.mode
        if message.mode == "abort":
            for rid in list(self.engine.request_ids()):
                self.engine.abort(rid, "abort")
            self.pooling.abort(self.pooling.queue.rids(), self.step_count)
        self.reply(protocol.PauseState(qid=message.qid, reply_to=message.reply_to, paused=True, mode=message.mode))

    def on_resume(self, message: protocol.Resume) -> None:
        moved = self.engine.follow_latest() if self.paused and self.pause_mode == "keep" else 0
        self.paused = False
        self.reply(protocol.PauseState(qid=message.qid, reply_to=message.reply_to, paused=False,
                                       mode=self.pause_mode, moved_to_latest=moved))

    def on_abort(self, message: protocol.Abort) -> None:
        rids = list(self.engine.request_ids()) if message.all else message.rids
        for rid in (self.held.rids() if message.all else rids):
            held = self.held.pop(rid)
            if held is not None:
                self.out.send(protocol.RequestError(rid=rid, reply_to=held.reply_to, status=409,
                                                    code="aborted", message="aborted while waiting for its "
                                                    "policy version"))
        for rid in (self.compiling.rids() if message.all else rids):
            parked = self.compiling.pop(rid)
            if parked is not None:
                self.out.send(protocol.RequestError(rid=rid, reply_to=parked.reply_to, status=409, code="aborted",
                                                    message="aborted while its grammar compiled"))
        self.pooling.abort(self.pooling.queue.rids() if message.all else rids, self.step_count)
        for rid in rids:
            self.engine.abort(rid, message.reason)
        for rid, index in message.sequences:
            self.engine.abort(rid, message.reason, index=index)

    def refuse(self, error: protocol.RequestError) -> None:
        """A message the codec rejected (a wrong field type, a value outside an enum) is answered, through
        the detokenizer, to the client it names; it never reaches the engine."""
        self.out.send(error, block=False)

    def answer(self, message: protocol.Message) -> None:
        """Replies and errors go to the detokenizer, which routes them to their client."""
        self.out.send(message)

    def reply(self, message: protocol.Reply) -> None:
        """Send a control reply to whoever asked (nothing when the request named no qid: a trainer's
        publish on the PUB socket)."""
        if message.qid and message.reply_to:
            self.out.send(message)

    def on_submit(self, message: protocol.Submit, *, held_since: float | None = None) -> None:
        spec = message.spec
        if spec.pooling is not None:
            self.pooling.submit(message)
            return
        if self.compiling.needs(spec.params.constraint):  # compiled off the loop, then submitted again
            self.compiling.add(message.rid, message, spec.params.constraint)
            return
        try:
            self.engine.add_request(Request(message.rid, protocol.unpack_ids(message.prompt_ids), spec,
                                            unpack_images(message.images)))
        except RequestRejected as exc:
            if not self.held.hold(message.rid, message, status=exc.status, min_version=spec.min_version,
                                  since=held_since):
                self.out.send(rejection(message.rid, message.reply_to, exc))
            return
        self.out.send(protocol.Track(rid=message.rid, reply_to=message.reply_to, prompt_ids=message.prompt_ids,
                                     spec=spec, replica=self.rt.replica))

    def take_arrivals(self) -> None:
        """Between a step's prefill pass and its decode pass (Engine.step's `arrivals`): the Submits that
        arrived while the prefill pass ran go in, so that their prompts ride in the decode pass. Reading
        stops at the first message of another kind (an adapter version a later Submit may ask for, an
        abort, a pause): it is handled right after the step, before anything read after it."""
        if self.deferred is not None:
            return
        for message in self.inbox.drain():
            self.handled += 1
            if type(message) is not protocol.Submit:
                self.deferred = message
                return
            self.safely(self.handlers[protocol.Submit], message)

    def handle_deferred(self) -> None:
        message, self.deferred = self.deferred, None
        if message is not None:
            self.safely(self.handlers[type(message)], message)

    def send(self, outputs: list[SeqOutput | ScoreResult]) -> None:
        """A step's outputs: the sequences' in one StepOutputs, each finished score's reply to its client."""
        deltas = []
        for o in outputs:
            if isinstance(o, ScoreResult):
                self.out.send(score_reply(o, self.scores.pop(o.qid, b"")))
            else:
                deltas.append(to_delta(o))
        if deltas:
            self.out.send(protocol.StepOutputs(step=self.step_count, time=time.time(),
                                               batch_size=self.engine.last_batch_size, outputs=deltas))

    def admit_compiled(self) -> None:
        """Requests whose grammar finished compiling go in (a failed one is refused by add_request with the
        cached error); one whose grammar is still compiling at engine.constraint_timeout_s is refused."""
        ready, expired = self.compiling.take()
        for message in ready:
            self.on_submit(message)
        for message in expired:
            self.out.send(protocol.RequestError(
                rid=message.rid, reply_to=message.reply_to, status=400, code="constraint_too_complex",
                param="constraint", message=f"constraint: the grammar did not compile within "
                f"{self.compiling.timeout_s:g} s (engine.constraint_timeout_s); simplify or shorten it"))

    def retry_held(self) -> None:
        """Requests waiting for a policy version (staleness_policy "hold"): admitted once it is
        published, refused with 409 after adapters.hold_timeout_s."""
        for since, message in self.held.take():
            self.on_submit(message, held_since=since)

    def on_score(self, message: protocol.Score) -> None:
        """Queue the score as prefill work of the next steps; `send` answers it when it is done."""
        try:
            self.engine.add_score(message.qid, protocol.unpack_ids(message.ids), start=message.start,
                                  top_logprobs=message.top_logprobs, adapter=message.adapter,
                                  adapter_version=message.adapter_version)
        except RequestRejected as exc:
            self.out.send(rejection(message.qid, message.reply_to, exc))
            return
        self.scores[message.qid] = message.reply_to

    def in_flight(self) -> int:
        return len(self.engine.request_ids()) + len(self.held) + len(self.compiling) + len(self.pooling.queue)

    def check_pending_s(self) -> float | None:
        """Seconds until the idle integrity check is due (0 or less: due now), None when none is owed or
        the engine holds work (paused with requests: it waits for the next idle spell)."""
        if self.step_count == self._checked_at_step or self.engine.has_work():
            return None
        return self._last_step_at + IDLE_CHECK_AFTER_S - time.perf_counter()

    def check_when_idle(self) -> None:
        """The engine's check_integrity() once each time it goes idle after steps (no leaked block, row
        or reference: what the tests run after every scenario, here for every burst a server serves),
        IDLE_CHECK_AFTER_S after the last step (a request that arrives sooner is served first, and the
        check waits for the next idle spell); a failure is logged and counted
        (EngineStats.integrity_failures), not fatal."""
        due = self.check_pending_s()
        if due is None or due > 0:
            return
        self._checked_at_step = self.step_count
        self.integrity_checks += 1
        try:
            self.engine.check_integrity()
        except AssertionError as exc:
            self.integrity_failures += 1
            log.error("engine integrity check failed after step %d: %s", self.step_count, exc)

    def stats(self) -> protocol.EngineStats:
        stats = self.engine.stats()
        stats.paused, stats.held_for_version, stats.received = self.paused, len(self.held), self.handled
        stats.replica = self.rt.replica
        stats.integrity_checks, stats.integrity_failures = self.integrity_checks, self.integrity_failures
        self.pooling.count(stats)
        staging, pending = self.staging, self.staging.pending
        stats.weights = protocol.WeightsStatus(
            receiving=pending.update_id if pending else "", received=pending.received if pending else 0,
            chunks=pending.chunks if pending else 0, rejected=staging.rejected, last_error=staging.last_error,
            last_error_code=staging.last_error_code, last_error_at=staging.last_error_at)
        stats.replicas = self.reports.others()
        stats.dropped_frames = self.inbox.dropped + self.adapter_sub.dropped
        stats.training_share, stats.training_phases = self.share.share, self.share.phases
        stats.training_updating, stats.training_rest_s = self.share.training(), self.share.rested_s
        stats.loop = self.loop_stats()
        if self.blas is not None:
            stats.blas = self.blas.stats()
        return stats

    # ------------------------------------------------------------------ faults
    def fail_in_flight(self, exc: Exception) -> int:
        """A step raised (MLX out of memory, a kernel error): the engine's state cannot be trusted.
        Every request in it ends with a retryable 503 and the stage exits non-zero, so the
        supervisor restarts it (and announces it, which fails anything this message missed)."""
        log.exception("engine step failed; failing %d request(s) and exiting for a restart",
                      len(self.engine.request_ids()))
        for rid in [*self.engine.request_ids(), *self.pooling.queue.rids()]:  # a score's qid: to its reply_to
            self.out.send(protocol.RequestError(rid=rid, reply_to=self.scores.get(rid, b""), status=503,
                                                code="engine_error", retryable=True,
                                                message=f"the engine failed ({type(exc).__name__}) while this "
                                                        "request was in flight; retry it"), block=False)
        time.sleep(0.3)  # sockets close with LINGER 0: let the errors leave first
        return 1

    # ------------------------------------------------------------------ loop
    def tick(self) -> None:
        self.reports.tick(self.stats)
        if self.fanout is not None and self.fanout.pending:
            self.fanout.expire()

    def idle_wait_ms(self) -> int:
        wait = min(self.beat_ms, 20) if self.compiling or self.reads else self.beat_ms  # look again soon
        due = self.check_pending_s()
        if due is not None:  # wake for the idle integrity check
            wait = min(wait, max(1, math.ceil(due * 1000)))
        resting = self.share.resting_s()
        return min(wait, max(1, math.ceil(resting * 1000))) if resting else wait

    def work(self) -> bool:
        """Between polls: requests waiting for a version or a grammar, chunked weight updates' timeouts,
        then one engine step and its outputs out. `loop_time` splits a working iteration into inbox (the
        skeleton's polling and handling, and this housekeeping), step (the engine), send (encoding and
        pushing the outputs) and beat."""
        clock, spent = time.perf_counter, self.loop_time
        t0 = clock()
        if self.held:
            self.retry_held()
        if self.compiling:
            self.admit_compiled()
        if self.reads:
            self.take_reads()
        if self.staging.pending is not None or self.staging.spent:
            self.expire_weights()
        if self.share.resting_s():  # a trainer's update has the device for now
            spent["inbox_s"] += clock() - t0
            return False
        paused_owing = self.paused and self.engine.owes_outputs()
        generating = paused_owing or (self.engine.has_work() and not self.paused)
        pooling = bool(self.pooling.queue) and not self.paused
        if not (generating or pooling):
            self.on_idle()
            self.check_when_idle()
            return False
        t1 = clock()
        self.step_count += 1
        outputs: list[SeqOutput | ScoreResult] = []
        pooled: list[Pooled] = []
        try:
            if generating:
                outputs = self.generate(paused_owing)
            if pooling:  # one batched pooling pass between two generation steps
                pooled = self.pooling.queue.step()
        except Exception as exc:  # noqa: BLE001 - e.g. MLX out of memory: fail fast, get restarted
            self.stop(self.fail_in_flight(exc))
            return False
        t2 = self._last_step_at = clock()
        self.share.after_step(t2 - t1)
        if outputs:
            self.send(outputs)
        self.handle_deferred()
        self.pooling.send(pooled, self.step_count)
        spent["inbox_s"] += t1 - t0
        spent["step_s"] += t2 - t1
        spent["send_s"] += clock() - t2
        return True

    def generate(self, paused_owing: bool) -> list[SeqOutput | ScoreResult]:
        """One engine step (a paused engine's flush of what it owes), under its deadline; the first tokens
        sampled by the step's prefill pass go out before its decode pass runs."""
        if self.deadline is not None:
            self.deadline.begin(*step_kind_and_work(self.engine))
        try:
            if paused_owing:
                return self.engine.flush()
            if self.arrivals is None:
                return self.engine.step(emit=self.send)
            return self.engine.step(emit=self.send, arrivals=self.arrivals)
        finally:
            if self.deadline is not None:
                self.deadline.end()


def warm_up(engine: Engine) -> float:
    """The engine's warm-up (what MLX builds on first use) while the compile thread builds the grammar
    constraints' tokenizer, both before the stage serves: built when a first grammar compiled, that build held
    the GIL beside running rows (0.6-0.9 s for SmolLM2 on a CPU; issue 30). A model whose tokenizer cannot be
    used is logged; its constrained requests are refused with a 400 saying so. Returns the warm-up's seconds."""
    grammar = engine.constraints.prepare()
    seconds = engine.warm_up()
    log.info("warm-up took %.2f s", seconds)
    t0 = time.perf_counter()
    try:
        grammar.result()
    except GrammarError:
        pass
    log.info("grammar tokenizer ready %.2f s after the warm-up", time.perf_counter() - t0)
    return seconds


def main(config: Config, replica: int = 0) -> int:
    if not generates(config):  # model.path is a pooling model: the pooling queue is the whole engine
        return pooling_only_main(config, StageRuntime(config, "engine", replica))
    tp = config.engine.tensor_parallel
    if tp > 1 and distributed.rank_from_env() > 0:
        return distributed.follower_main(config, replica)  # rank > 0 of a tensor-parallel group: no sockets
    runtime = StageRuntime(config, "engine", replica)
    from parallm.models import ModelLoadError, load_model

    try:
        group = distributed.join(tp, distributed.default_backend()) if tp > 1 else None
        loaded = load_model(config.model, kv_budget_mb=config.engine.kv_budget_mb)
        if group is not None:
            distributed.shard_model(loaded.model, group)
            config = distributed.agreed_config(config, group)
    except (ModelLoadError, distributed.TensorParallelError) as exc:
        runtime.fatal(f"cannot load model {config.model.path!r}: {exc}")
        return 2
    from parallm.engine import UnsupportedModel
    from parallm.models.preload import load_adapters_at_start

    draft = None
    if config.spec.mode == "draft":
        from parallm.models import load_draft

        try:
            draft = load_draft(config).model
        except ModelLoadError as exc:
            runtime.fatal(f"cannot load the draft model {config.spec.draft_model!r}: {exc}")
            return 2
    try:
        engine = Engine(dataclasses.replace(EngineModel.of(loaded), draft=draft), config)
    except UnsupportedModel as exc:  # refused at start, naming why (parallm.engine.compat)
        runtime.fatal(f"cannot serve model {config.model.path!r}: {exc}")
        return 2
    except ValueError as exc:  # a setting this model cannot run with, named (--kv.group-size, --engine.kv-budget-mb)
        runtime.fatal(f"cannot start the engine on model {config.model.path!r}: {exc}")
        return 2
    try:
        preloaded = load_adapters_at_start(engine, config.adapters.preload)
    except (ValueError, AdapterError) as exc:
        runtime.fatal(f"cannot load the adapters of adapters.preload: {exc}")
        return 2
    if preloaded:
        log.info("adapters loaded at start: %s", ", ".join(preloaded))
    if group is not None:
        distributed.freeze_clock(engine)
    warm_up_s = warm_up(engine)
    if group is not None:
        engine = distributed.lead(engine, loaded.model, group,
                                  distributed.control_addresses(config.transport.run_dir, replica), warm_up_s)
        runtime.step_progress = engine.step_progress  # the heartbeat carries each step's deadline
    info = {"model": config.model.served_name, "path": str(loaded.source.path), "dtype": loaded.dtype,
            "max_model_len": loaded.max_model_len, "vocab_size": loaded.vocab_size}
    try:
        from parallm.pooling.load import load_entry

        models = {m.info.name: m for m in (load_entry(e, config.model.cache_dir) for e in config.model.pooling)}
    except (ModelLoadError, ValueError) as exc:
        runtime.fatal(f"cannot load the pooling models of model.pooling: {exc}")
        return 2
    info["pooling"] = sorted(models)
    stage = EngineStage(config, runtime, engine, info, PoolingQueue(models, config.engine.pooling_batch_tokens),
                        warm_up_s=warm_up_s)
    if group is not None:
        stage.on_idle = engine.idle  # takes the other ranks' acks while no step does
    if stage.blas is not None:
        stage.blas.start()  # samples and sets the OpenBLAS thread count on a thread of its own
        engine.constraints.background = stage.blas.background  # a grammar compiling is left a core
    runtime.ready(info)
    if config.kv.disk_dir:  # stop the loop on SIGTERM too, so the disk tier's blocks are written (engine.close)
        signal.signal(signal.SIGTERM, lambda *_: setattr(runtime, "shutting_down", True))
    try:
        code = stage.run()
        if group is not None and code == 0:
            engine.close()  # the other ranks return from their follower loop
        elif group is None:
            engine.close(3.0)  # the disk tier's blocks (kv.disk_dir), within the supervisor's 5 s stop
        return code
    finally:
        if stage.blas is not None:
            stage.blas.stop()
        stage.staging.close()  # a chunked weight update still being received: its staged chunks
        runtime.close()
