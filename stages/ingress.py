"""The ingress stage: the OpenAI HTTP API (Starlette on uvicorn) in front of the ZeroMQ pipeline.

It knows nothing of MLX. Requests go to the tokenizers; results come back from the
detokenizer's ROUTER, dispatched to per-request queues by one reader task. When the
supervisor announces a dead stage, every request that stage could have held ends at once
with a retryable 503, so no client waits on a request that no longer exists.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from parallm import protocol
from parallm.api.app import build_app
from parallm.api.backend import BackendError
from parallm.config import Config
from parallm.metrics import ServerMetrics
from parallm.runtime import StageRuntime
from parallm.transport import Sender, open_socket

log = logging.getLogger("parallm.ingress")

QUERY_TIMEOUT_S = 30.0
STATS_PERIOD_S = 0.5      # how often ingress asks the engine and detokenizer for their stats
STATS_TIMEOUT_S = 5.0


@dataclass
class _Pending:
    queue: asyncio.Queue
    heard: bool = False            # something came back from the detokenizer: the engine has it
    first_output_at: float = 0.0
    submitted_at: float = field(default_factory=time.monotonic)


class ZmqBackend:
    """The api.Backend that talks to the pipeline over ZeroMQ."""

    def __init__(self, config: Config, runtime: StageRuntime, model_info: dict[str, Any],
                 metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self.rt = runtime
        self.model_name = config.model.served_name
        self.max_model_len = int(model_info.get("max_model_len", 0))
        self.default_max_tokens = config.engine.default_max_tokens
        self.max_n = config.engine.max_num_seqs
        self.model_info = model_info
        self.identity = f"ingress-{os.getpid()}".encode()
        addrs = runtime.addrs
        hwm = config.transport.hwm
        self.actx = zmq.asyncio.Context()
        self.dealer = open_socket(self.actx, zmq.DEALER, addrs.router, bind=False, identity=self.identity, hwm=hwm)
        self.to_tokenizers = Sender(open_socket(runtime.ctx, zmq.PUSH, addrs.tokenizers, bind=False, hwm=hwm))
        self.to_engine = Sender(open_socket(runtime.ctx, zmq.PUSH, addrs.engine, bind=False, hwm=hwm))
        self.decoder = protocol.Decoder(protocol.ClientInbound)
        self.training_in = open_socket(self.actx, zmq.PULL, addrs.training, bind=True, hwm=hwm)
        self.training_decoder = protocol.Decoder(protocol.TrainingStatus)
        self.trainers: dict[str, protocol.TrainingStatus] = {}
        self.pending: dict[str, _Pending] = {}
        self.replies: dict[str, asyncio.Future] = {}
        self.stages_down: set[str] = set()
        self.requests_total = 0
        self.last_batch_size = 0       # engine batch size of the latest Outputs (RL /generate metadata)
        self.tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            await self.dealer.send(protocol.encode(protocol.Hello(client=self.identity.decode())))
            if await self.dealer.poll(500, zmq.POLLIN):
                message = self.decoder.decode(await self.dealer.recv())
                if isinstance(message, protocol.Welcome):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the detokenizer's router never answered Hello")
        self.tasks = [asyncio.create_task(self._read(), name="ingress-read"),
                      asyncio.create_task(self._control(), name="ingress-control"),
                      asyncio.create_task(self._poll_stats(), name="ingress-stats"),
                      asyncio.create_task(self._read_training(), name="ingress-training")]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()

    # ------------------------------------------------------------------ inbound
    async def _read(self) -> None:
        while True:
            frames = await self.dealer.recv_multipart()
            try:
                message = self.decoder.decode(frames[-1])
            except protocol.ProtocolError as exc:
                log.warning("dropped a malformed message from the router: %s", exc)
                continue
            if isinstance(message, protocol.Outputs):
                self.last_batch_size = message.batch_size
                for item in message.items:
                    self._deliver(item.rid, item)
            elif isinstance(message, protocol.RequestError):
                future = self.replies.pop(message.rid, None)
                if future is not None:
                    if not future.done():
                        future.set_result(message)
                else:
                    self._deliver(message.rid, message)
            elif isinstance(message, protocol.REPLIES):
                future = self.replies.pop(message.qid, None)
                if future is not None and not future.done():
                    future.set_result(message)

    async def _read_training(self) -> None:
        """Trainers' TrainingStatus pushes: kept (latest per trainer) for /v1/training/status and /metrics."""
        while True:
            frame = await self.training_in.recv()
            try:
                status = self.training_decoder.decode(frame)
            except protocol.ProtocolError as exc:
                log.warning("dropped a malformed training status: %s", exc)
                continue
            self.trainers[status.trainer] = status
            self.metrics.set_training_status(msgspec.structs.asdict(status))

    def training_status(self) -> dict[str, Any]:
        now = time.time()
        trainers = [{**msgspec.structs.asdict(s), "age_s": round(max(0.0, now - s.updated_at), 3)}
                    for s in self.trainers.values()]
        return {"object": "training.status", "active": any(t["state"] in ("starting", "running") for t in trainers),
                "trainers": trainers}

    def _deliver(self, rid: str, item: Any) -> None:
        pending = self.pending.get(rid)
        if pending is None:
            if isinstance(item, protocol.Output) and item.finish_reason is None:
                self.to_engine.send(protocol.Abort(rids=[rid], reason="abort"), block=False)
            return
        pending.heard = True
        pending.queue.put_nowait(item)

    async def _control(self) -> None:
        while True:
            for message in self.rt.poll_control():
                if isinstance(message, protocol.StageDown):
                    self.stages_down.add(f"{message.stage}-{message.replica}")
                    self.metrics.stage_restarts.labels(message.stage).inc()
                    self._fail_in_flight(message.stage)
                elif isinstance(message, protocol.StageUp):
                    self.stages_down.discard(f"{message.stage}-{message.replica}")
                self.metrics.stages_down.set(len(self.stages_down))
            self.rt.heartbeat(lambda: len(self.pending))
            await asyncio.sleep(0.05)

    def _fail_in_flight(self, stage: str) -> None:
        """Fail what the dead stage may have held: everything for engine/detokenizer, unheard ones for a tokenizer."""
        lost = [rid for rid, p in self.pending.items() if stage != "tokenizer" or not p.heard]
        for rid in lost:
            self.pending[rid].queue.put_nowait(protocol.RequestError(
                rid=rid, status=503, code="stage_restarted", retryable=True,
                message=f"the {stage} stage restarted while this request was in flight; retry it"))
        if lost and stage != "engine":
            self.to_engine.send(protocol.Abort(rids=lost, reason="abort"), block=False)
        log.warning("%s died: failed %d in-flight request(s)", stage, len(lost))

    async def _poll_stats(self) -> None:
        """Engine and detokenizer stats for /metrics, /health and the queue bound, every STATS_PERIOD_S."""
        while True:
            for stage in ("engine", "detokenizer"):
                if any(down.startswith(stage) for down in self.stages_down):
                    continue
                try:
                    reply = await self._ask(stage, protocol.GetStats(qid="", reply_to=b""), timeout=STATS_TIMEOUT_S)
                except BackendError:
                    continue
                self.metrics.set_stats(reply.stats)
            await asyncio.sleep(STATS_PERIOD_S)

    @property
    def engine_waiting(self) -> int:
        return self.metrics.engine_stats.waiting

    def _queue_full(self) -> bool:
        bound = self.config.server.max_queued_requests
        return bool(bound) and self.engine_waiting >= bound

    # ------------------------------------------------------------------ Backend API
    async def generate(self, submit: protocol.TextSubmit) -> AsyncIterator[protocol.Output]:
        if self.rt.draining:
            raise BackendError(503, "shutting_down", "the server is shutting down", retryable=True)
        if self.stages_down:
            self.metrics.rejected.labels("stage_down").inc()
            raise BackendError(503, "service_unavailable", "a stage is restarting; retry shortly", retryable=True)
        if self._queue_full():
            self.metrics.rejected.labels("queue_full").inc()
            raise BackendError(503, "queue_full", f"{self.engine_waiting} requests are already waiting for the "
                               "engine (server.max_queued_requests); retry shortly", retryable=True)
        submit.reply_to = self.identity
        submit.spec.submitted_at = submit.spec.submitted_at or time.time()
        pending = _Pending(asyncio.Queue())
        self.pending[submit.rid] = pending
        self.requests_total += 1
        remaining = submit.spec.n
        last_token_at: dict[int, float] = {}
        try:
            if not self.to_tokenizers.send(submit, block=False):
                raise BackendError(503, "overloaded", "the tokenizer queue is full; retry shortly", retryable=True)
            while remaining:
                item = await pending.queue.get()
                if isinstance(item, protocol.RequestError):
                    raise BackendError(item.status, item.code, item.message, param=item.param,
                                       retryable=item.retryable)
                self._time_tokens(pending, item, last_token_at)
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self.pending.pop(submit.rid, None)
            if remaining:
                self.to_engine.send(protocol.Abort(rids=[submit.rid], reason="abort"), block=False)

    def _time_tokens(self, pending: _Pending, item: protocol.Output, last_token_at: dict[int, float]) -> None:
        """TTFT per request, inter-token latency per sequence (a step's tokens share its gap)."""
        tokens = protocol.count_ids(item.token_ids)
        if not tokens:
            return
        now = time.monotonic()
        if not pending.first_output_at:
            pending.first_output_at = now
            self.metrics.ttft.observe(now - pending.submitted_at)
        last = last_token_at.get(item.index)
        if last is not None:
            gap = (now - last) / tokens
            for _ in range(tokens):
                self.metrics.itl.observe(gap)
        last_token_at[item.index] = now
        if item.finish_reason is not None:
            self.metrics.e2e.observe(now - pending.submitted_at)

    async def _ask(self, target: str, message: Any, timeout: float = QUERY_TIMEOUT_S) -> Any:
        """Send a control request to `target` and await its reply (a RequestError answer raises)."""
        message.qid, message.reply_to = uuid.uuid4().hex, self.identity
        future = asyncio.get_running_loop().create_future()
        self.replies[message.qid] = future
        if target == "detokenizer":
            await self.dealer.send(protocol.encode(message))
        else:
            sender = self.to_engine if target == "engine" else self.to_tokenizers
            sender.send(message, block=False)
        try:
            reply = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self.replies.pop(message.qid, None)
            raise BackendError(503, "timeout", f"the {target} did not answer", retryable=True) from None
        if isinstance(reply, protocol.RequestError):
            raise BackendError(reply.status if reply.status >= 400 else 400, reply.code, reply.message,
                               param=reply.param, retryable=reply.retryable)
        return reply

    async def engine_stats(self) -> protocol.EngineStats:
        return (await self._ask("engine", protocol.GetStats(qid="", reply_to=b""))).stats

    async def pause(self, mode: str) -> protocol.PauseState:
        return await self._ask("engine", protocol.Pause(mode=mode))

    async def resume(self) -> protocol.PauseState:
        return await self._ask("engine", protocol.Resume())

    async def abort(self, rids: list[str], *, all: bool = False) -> None:
        self.to_engine.send(protocol.Abort(rids=list(rids), all=all, reason="abort"), block=False)

    async def load_adapter(self, request: protocol.AdapterPublish) -> protocol.AdapterLoaded:
        return await self._ask("engine", request)

    async def unload_adapter(self, name: str) -> protocol.AdapterUnloaded:
        return await self._ask("engine", protocol.AdapterUnload(name=name))

    async def list_adapters(self) -> protocol.AdapterList:
        return await self._ask("engine", protocol.ListAdapters(qid="", reply_to=b""))

    async def tokenize(self, request: protocol.Tokenize) -> list[int]:
        return protocol.unpack_ids((await self._ask("tokenizer", request)).ids)

    async def detokenize(self, request: protocol.Detokenize) -> str:
        return (await self._ask("tokenizer", request)).text

    def health(self) -> dict[str, Any]:
        limit = self.config.server.max_concurrent_requests
        if self.rt.draining:
            status = "shutting_down"
        elif self.stages_down:
            status = "degraded"
        elif (limit and len(self.pending) >= limit) or self._queue_full():
            status = "overloaded"
        else:
            status = "ok"
        return {"status": status, "ready": status in ("ok", "overloaded"), "stages_down": sorted(self.stages_down),
                "in_flight": len(self.pending), "waiting": self.engine_waiting,
                "running": self.metrics.engine_stats.running}


def main(config: Config, replica: int = 0) -> int:
    import uvicorn

    runtime = StageRuntime(config, "ingress", replica)
    from parallm.text.loading import model_limits

    info = model_limits(config.model)
    metrics = ServerMetrics()
    backend = ZmqBackend(config, runtime, info, metrics)
    app = build_app(backend, config.server, metrics)

    server_config = uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                   loop="uvloop" if _has_uvloop() else "asyncio", log_level="warning",
                                   timeout_graceful_shutdown=int(config.supervisor.drain_timeout_s))
    server = uvicorn.Server(server_config)

    async def serve() -> None:
        await backend.start()
        serve_task = asyncio.create_task(server.serve())
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.05)
        if serve_task.done():
            await serve_task
            return
        runtime.ready({"url": f"http://{config.server.host}:{config.server.port}"})
        while not serve_task.done():
            if runtime.shutting_down:
                server.should_exit = True
            await asyncio.sleep(0.1)
        await backend.stop()

    try:
        if _has_uvloop():
            import uvloop

            uvloop.run(serve())
        else:
            asyncio.run(serve())
    except OSError as exc:
        runtime.fatal(f"cannot serve HTTP on {config.server.host}:{config.server.port}: {exc}")
        return 2
    return 0


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
