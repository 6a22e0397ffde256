"""The engine stage: the only process that imports the model.

One busy loop: drain the inbox, run one engine step, push that step's outputs (one message for
all rows) to the detokenizer. While idle it blocks on the inbox for up to a heartbeat.
A request the engine refuses gets a RequestError routed to its client; nothing else stops.
Adapter versions arrive on the bound `adapters` SUB socket (trainers' PUBs connect to it) or on
the inbox; each is loaded between two steps, so a version takes effect at a step boundary.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import mlx.core as mx
import zmq

from parallm import blas, protocol
from parallm.adapters import AdapterError
from parallm.config import Config
from parallm.engine import Engine, Request, RequestRejected, SeqOutput
from parallm.runtime import StageRuntime
from parallm.transport import Receiver, Sender, open_socket

log = logging.getLogger("parallm.engine.stage")


def to_delta(out: SeqOutput) -> protocol.SeqDelta:
    delta = protocol.SeqDelta(rid=out.rid, index=out.index, token_ids=protocol.pack_ids(out.token_ids),
                              finish_reason=out.finish_reason, adapter=out.adapter, version=out.version,
                              usage=out.usage)
    if out.logprobs is not None:
        delta.logprobs = protocol.pack_floats(out.logprobs)
    if out.top_logprobs:
        delta.top_ids = protocol.pack_ids([tid for row in out.top_logprobs for tid, _ in row])
        delta.top_logprobs = protocol.pack_floats([lp for row in out.top_logprobs for _, lp in row])
    if out.prompt_logprobs is not None:
        delta.prompt_logprobs = protocol.pack_floats([float("nan") if lp is None else lp
                                                      for lp in out.prompt_logprobs])
        if out.prompt_top_logprobs:
            delta.prompt_top_ids = protocol.pack_ids([tid for row in out.prompt_top_logprobs if row
                                                            for tid, _ in row])
            delta.prompt_top_logprobs = protocol.pack_floats([lp for row in out.prompt_top_logprobs if row
                                                              for _, lp in row])
    return delta


def rejection_code(exc: RequestRejected) -> str:
    """OpenAI's error code for a refused request: the engine's own (e.g. context_length_exceeded)."""
    return exc.code or "invalid_request_error"


ADAPTER_QUERIES = ("policy", "adapters", "adapter_load", "adapter_unload")


def load_adapter(engine: Engine, name: str, *, config: dict | None = None, weights: bytes | None = None,
                 path: str = "", format: str = "auto", version: int = 0) -> dict[str, Any]:
    """Load a version (raises AdapterError); answered in the MLX RL Inference Server's shape plus ours."""
    t0 = time.perf_counter()
    adapter = engine.load_adapter(name, config=config, weights=weights, path=path, format=format, version=version)
    ms = 1000 * (time.perf_counter() - t0)
    log.info("adapter %s version %d loaded (%s, rank %d, %d modules, %.1f ms)", name, adapter.version,
             adapter.kind, adapter.rank, len(adapter.modules), ms)
    return {"status": "success", "policy_version": adapter.version, "name": name, "version": adapter.version,
            "bytes": adapter.nbytes, "load_ms": ms,
            "message": f"adapter {name!r} version {adapter.version} loaded; new requests use it from the next step"}


def adapter_query(engine: Engine, what: str, args: dict[str, Any]) -> Any:
    """The engine's answer to an adapter Query (`what` in ADAPTER_QUERIES); AdapterError on failure."""
    if what == "policy":
        return engine.policy()
    if what == "adapters":
        return {"adapters": engine.adapters.describe(), "policy": engine.policy(), **engine.adapters.stats()}
    try:
        name = str(args.get("name", ""))
        if what == "adapter_unload":
            return {"status": "success", "name": name, "versions_removed": engine.unload_adapter(name)}
        weights = args.get("weights")
        config = args.get("config") or None
        if config is not None and not isinstance(config, dict):
            raise AdapterError("config must be a map")
        return load_adapter(engine, name, config=config, weights=bytes(weights) if weights else None,
                            path=str(args.get("path", "")), format=str(args.get("format", "auto")),
                            version=int(args.get("version", 0)))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, AdapterError):
            raise
        raise AdapterError(f"bad adapter arguments: {exc}") from None


class EngineStage:
    def __init__(self, config: Config, runtime: StageRuntime, engine: Engine, model_info: dict[str, Any]) -> None:
        self.config = config
        self.rt = runtime
        self.engine = engine
        self.model_info = model_info
        ctx = runtime.ctx
        hwm = config.transport.hwm
        self.inbox: Receiver = Receiver(open_socket(ctx, zmq.PULL, runtime.addrs.engine, bind=True, hwm=hwm),
                                        protocol.EngineInbound, name="engine")
        self.out = Sender(open_socket(ctx, zmq.PUSH, runtime.addrs.detok, bind=False, hwm=hwm))
        sub = open_socket(ctx, zmq.SUB, runtime.addrs.adapters, bind=True, hwm=hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.adapter_sub: Receiver = Receiver(sub, protocol.EngineInbound, name="adapters")
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.sock, zmq.POLLIN)
        self.poller.register(sub, zmq.POLLIN)
        self.poller.register(runtime.control.sock, zmq.POLLIN)
        self.blas = blas.ThreadGovernor.for_this_process() if mx.default_device() == mx.cpu else None
        self.paused = False
        self.pause_mode = "keep"
        self.held: dict[str, tuple[float, protocol.Submit]] = {}  # rid -> (since, request) waiting for a version
        self.step_count = 0
        self.received = 0
        self.loop_time: Counter[str] = Counter()  # seconds per loop phase, over working iterations
        self.loop_steps = 0

    # ------------------------------------------------------------------ messages
    def handle(self, message: Any) -> None:
        self.received += 1
        if isinstance(message, protocol.Submit):
            self.on_submit(message)
        elif isinstance(message, protocol.Abort):
            rids = list(self.engine.request_ids()) if message.all else message.rids
            for rid in (list(self.held) if message.all else rids):
                held = self.held.pop(rid, None)
                if held is not None:
                    self.out.send(protocol.RequestError(rid=rid, reply_to=held[1].reply_to, status=409,
                                                        code="aborted", message="aborted while waiting for its "
                                                        "policy version"))
            for rid in rids:
                self.engine.abort(rid, message.reason)
            for rid, index in message.sequences:
                self.engine.abort(rid, message.reason, index=index)
        elif isinstance(message, protocol.Query):
            self.on_query(message)
        elif isinstance(message, protocol.Score):
            self.on_score(message)
        elif isinstance(message, protocol.AdapterPublish):
            self.on_publish(message)
        elif isinstance(message, protocol.AdapterUnload):
            self.on_unload(message)
        elif isinstance(message, protocol.Pause):
            self.paused = True
            self.pause_mode = message.mode
            if message.mode == "abort":
                for rid in list(self.engine.request_ids()):
                    self.engine.abort(rid, "abort")
            self._ack(message.qid, message.reply_to, {"paused": True, "mode": message.mode})
        elif isinstance(message, protocol.Resume):
            moved = self.engine.follow_latest() if self.paused and self.pause_mode == "keep" else 0
            self.paused = False
            self._ack(message.qid, message.reply_to, {"paused": False, "moved_to_latest": moved})
        else:
            self._ack(getattr(message, "qid", ""), getattr(message, "reply_to", b""), None,
                      error=f"{type(message).__name__} is not supported by this engine", status=501)

    def _ack(self, qid: str, reply_to: bytes, result: Any, *, error: str = "", status: int = 200) -> None:
        if qid and reply_to:
            self.out.send(protocol.QueryReply(qid=qid, reply_to=reply_to, ok=not error, result=result,
                                              error=error, status=status))

    # ------------------------------------------------------------------ adapters
    def on_publish(self, message: protocol.AdapterPublish) -> None:
        try:
            result = load_adapter(self.engine, message.name, config=message.config, weights=message.weights or None,
                                  path=message.path, format=message.format, version=message.version)
        except AdapterError as exc:
            log.warning("adapter %r version %d rejected: %s", message.name, message.version, exc.message)
            self._ack(message.qid, message.reply_to, None, error=exc.message, status=exc.status)
            return
        self._ack(message.qid, message.reply_to, result)

    def on_unload(self, message: protocol.AdapterUnload) -> None:
        try:
            result = adapter_query(self.engine, "adapter_unload", {"name": message.name})
        except AdapterError as exc:
            self._ack(message.qid, message.reply_to, None, error=exc.message, status=exc.status)
            return
        self._ack(message.qid, message.reply_to, result)

    def on_submit(self, message: protocol.Submit, *, held_since: float | None = None) -> None:
        request = Request(rid=message.rid, prompt_ids=protocol.unpack_ids(message.prompt_ids),
                          params=message.params, n=message.n, adapter=message.adapter,
                          adapter_version=message.adapter_version, min_version=message.min_version,
                          max_staleness=message.max_staleness, arrival=message.submitted_at or time.time())
        try:
            self.engine.add_request(request)
        except RequestRejected as exc:
            now = time.monotonic()
            waiting_for_version = exc.status == 409 and message.min_version > 0 and \
                self.config.adapters.staleness_policy == "hold"
            if waiting_for_version and now - (held_since or now) < self.config.adapters.hold_timeout_s:
                self.held[message.rid] = (held_since or now, message)
                return
            self.out.send(protocol.RequestError(rid=message.rid, reply_to=message.reply_to, status=exc.status,
                                                code=rejection_code(exc), message=str(exc), param=exc.param))
            return
        self.out.send(protocol.Track(rid=message.rid, reply_to=message.reply_to, n=message.n,
                                     prompt_ids=message.prompt_ids, detok=message.detok, stream=message.stream,
                                     adapter=message.adapter, stop_token_ids=message.params.stop_token_ids,
                                     min_tokens=message.params.min_tokens, metadata=message.metadata,
                                     submitted_at=message.submitted_at))

    def send(self, outputs: list[SeqOutput]) -> None:
        self.out.send(protocol.StepOutputs(step=self.step_count, time=time.time(),
                                           batch_size=self.engine.last_batch_size,
                                           outputs=[to_delta(o) for o in outputs]))

    def retry_held(self) -> None:
        """Requests waiting for a policy version (staleness_policy "hold"): admitted once it is
        published, refused with 409 after adapters.hold_timeout_s."""
        held, self.held = self.held, {}
        for since, message in held.values():
            self.on_submit(message, held_since=since)

    def on_score(self, message: protocol.Score) -> None:
        try:
            ids = protocol.unpack_ids(message.ids)
            result = self.engine.score(ids, start=message.start, top_logprobs=message.top_logprobs,
                                       adapter=message.adapter, adapter_version=message.adapter_version)
        except RequestRejected as exc:
            self.out.send(protocol.RequestError(rid=message.rid, reply_to=message.reply_to, status=exc.status,
                                                code=rejection_code(exc), message=str(exc), param=exc.param))
            return
        payload = {"logprobs": protocol.pack_floats(result.logprobs)}
        if result.top_logprobs:
            payload["top_ids"] = protocol.pack_ids([t for row in result.top_logprobs for t, _ in row])
            payload["top_logprobs"] = protocol.pack_floats([lp for row in result.top_logprobs for _, lp in row])
        self.out.send(protocol.QueryReply(qid=message.rid, reply_to=message.reply_to, result=payload))

    def on_query(self, message: protocol.Query) -> None:
        if message.what == "stats":
            self._ack(message.qid, message.reply_to, self.stats())
        elif message.what == "model":
            self._ack(message.qid, message.reply_to, self.model_info)
        elif message.what in ADAPTER_QUERIES:
            try:
                result = adapter_query(self.engine, message.what, message.args or {})
            except AdapterError as exc:
                self._ack(message.qid, message.reply_to, None, error=exc.message, status=exc.status)
                return
            self._ack(message.qid, message.reply_to, result)
        else:
            self._ack(message.qid, message.reply_to, None, error=f"unknown query {message.what!r}", status=404)

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        stats.update(held_for_version=len(self.held), paused=self.paused, received=self.received,
                     dropped_frames=self.inbox.dropped,
                     stage_loop_steps=self.loop_steps,
                     stage_ms_mean={k[:-2]: 1000 * v / max(1, self.loop_steps) for k, v in self.loop_time.items()})
        if self.blas is not None:
            stats.update(self.blas.stats())
        return stats

    # ------------------------------------------------------------------ faults
    def safely(self, message: Any) -> None:
        """Handle one message; one that breaks the engine's API is logged and dropped (with an
        error to its client when it names one), never fatal."""
        try:
            self.handle(message)
        except Exception as exc:  # noqa: BLE001 - a bad message must not take the engine down
            log.exception("could not handle a %s", type(message).__name__)
            rid, reply_to = getattr(message, "rid", ""), getattr(message, "reply_to", b"")
            if rid and reply_to:
                self.out.send(protocol.RequestError(rid=rid, reply_to=reply_to, status=400,
                                                    message=f"the engine could not handle this request: {exc}"))

    def fail_in_flight(self, exc: Exception) -> int:
        """A step raised (MLX out of memory, a kernel error): the engine's state cannot be trusted.
        Every request in it ends with a retryable 503 and the stage exits non-zero, so the
        supervisor restarts it (and announces it, which fails anything this message missed)."""
        log.exception("engine step failed; failing %d request(s) and exiting for a restart",
                      len(self.engine.request_ids()))
        for rid in self.engine.request_ids():
            self.out.send(protocol.RequestError(rid=rid, status=503, code="engine_error", retryable=True,
                                                message=f"the engine failed ({type(exc).__name__}) while this "
                                                        "request was in flight; retry it"), block=False)
        time.sleep(0.3)  # sockets close with LINGER 0: let the errors leave first
        return 1

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        """The loop: one poll of every socket (without waiting while there is work; up to a
        heartbeat while idle), drain the ready ones, one engine step, its outputs out.
        `loop_time` splits each working iteration into inbox (polling and handling messages),
        step (the engine), send (encoding and pushing the outputs) and beat."""
        beat_ms = max(1, int(self.config.supervisor.heartbeat_s * 1000))
        clock, spent = time.perf_counter, self.loop_time
        control = self.rt.control.sock
        timeout = 0
        while not self.rt.shutting_down:
            t0 = clock()
            if self.blas is not None:
                self.blas.tick()
            ready = dict(self.poller.poll(timeout))
            if ready:
                if self.adapter_sub.sock in ready:
                    for message in self.adapter_sub.drain():
                        self.safely(message)
                if self.inbox.sock in ready:
                    for message in self.inbox.drain():
                        self.safely(message)
                if control in ready:
                    self.rt.poll_control()
            if self.held:
                self.retry_held()
            paused_owing = self.paused and self.engine.owes_outputs()
            if not (paused_owing or (self.engine.has_work() and not self.paused)):
                timeout = beat_ms  # idle: the next poll waits for a message
                self.rt.heartbeat(self.stats)
                continue
            timeout = 0
            t1 = clock()
            self.step_count += 1
            try:
                # first tokens sampled by the step's prefill pass go out before its decode pass runs
                outputs = self.engine.flush() if paused_owing else self.engine.step(emit=self.send)
            except Exception as exc:  # noqa: BLE001 - e.g. MLX out of memory: fail fast, get restarted
                return self.fail_in_flight(exc)
            t2 = clock()
            if outputs:
                self.send(outputs)
            t3 = clock()
            self.rt.heartbeat(self.stats)
            self.loop_steps += 1
            spent["inbox_s"] += t1 - t0
            spent["step_s"] += t2 - t1
            spent["send_s"] += t3 - t2
            spent["beat_s"] += clock() - t3
        return 0


def main(config: Config, replica: int = 0) -> int:
    runtime = StageRuntime(config, "engine", replica)
    from parallm.models import ModelLoadError, load_model

    try:
        loaded = load_model(config.model)
    except ModelLoadError as exc:
        runtime.fatal(f"cannot load model {config.model.path!r}: {exc}")
        return 2
    engine = Engine(loaded.model, config.engine, eos_token_ids=loaded.eos_token_ids,
                    max_model_len=loaded.max_model_len, vocab_size=loaded.vocab_size,
                    adapter_history=config.adapters.history, adapter_merge_mb=config.adapters.merge_mb)
    log.info("warm-up took %.2f s", engine.warm_up())
    info = {"model": config.model.served_name, "path": str(loaded.source.path), "dtype": loaded.dtype,
            "max_model_len": loaded.max_model_len, "vocab_size": loaded.vocab_size}
    stage = EngineStage(config, runtime, engine, info)
    runtime.ready(info)
    try:
        return stage.run()
    finally:
        runtime.close()
