"""The ingress stage: the OpenAI HTTP API (Starlette on uvicorn) in front of the ZeroMQ pipeline.

It knows nothing of MLX. It talks to the pipeline through the same connection the raw clients
use (parallm/pipeline.py): requests go to the tokenizers, results come back from the detokenizer's
ROUTER, and when the supervisor announces a dead stage every request that stage could have held
ends at once with a retryable 503. Ingress adds its own duties: admission (draining, a stage down,
the engine's queue bound, a full tokenizer queue), request timings, the stats poll behind /metrics
and /health, and the trainers' status reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from parallm import protocol
from parallm.routing import replica_count
from parallm.api.app import build_app, build_policy_app
from parallm.api.backend import BackendError
from parallm.config import Config, generates, serves_lm
from parallm.metrics import ServerMetrics
from parallm.pipeline import Pipeline
from parallm.config.pooling import parse_entry
from parallm.pooling.spec import PoolingInfo, describe
from parallm.policies.client import AsyncPolicyClient
from parallm.runtime import StageRuntime
from parallm.streams import ClientError
from parallm.text.generation_config import GenerationDefaults, generation_defaults
from parallm.transport import open_socket

log = logging.getLogger("parallm.ingress")

HELLO_TIMEOUT_S = 60.0
QUERY_TIMEOUT_S = 30.0
WEIGHTS_TIMEOUT_S = 600.0  # a full-weight update from a checkpoint directory
STATS_PERIOD_S = 0.5      # how often ingress asks the engine and detokenizer for their stats
STATS_TIMEOUT_S = 5.0
ENGINE_STALLED_AFTER_S = 5.0
PRESSURE_ORDER = ("ok", "degraded", "overloaded")  # EngineStats.kv_pressure, mildest first  # /health says "stalled" (503) when the engine answered no stats poll this long


def backend_error(exc: ClientError) -> BackendError:
    return BackendError(exc.status if exc.status >= 400 else 400, exc.code, str(exc), param=exc.param,
                        retryable=exc.retryable)


class _Timings:
    """TTFT per request, inter-token latency per sequence (a step's tokens share its gap), e2e latency."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.submitted_at = time.monotonic()
        self.first_output_at = 0.0
        self.last_token_at: dict[int, float] = {}

    def observe(self, item: protocol.Output) -> None:
        tokens = protocol.count_ids(item.token_ids)
        if not tokens:
            return
        now = time.monotonic()
        if not self.first_output_at:
            self.first_output_at = now
            self.metrics.ttft.observe(now - self.submitted_at)
        last = self.last_token_at.get(item.index)
        if last is not None:
            gap = (now - last) / tokens
            for _ in range(tokens):
                self.metrics.itl.observe(gap)
        self.last_token_at[item.index] = now
        if item.finish_reason is not None:
            self.metrics.e2e.observe(now - self.submitted_at)


def pooling_infos(entries: list[str]) -> dict[str, PoolingInfo]:
    """model.pooling's models as the supervisor resolved them ('NAME:TASK=DIR'), read without loading them."""
    out = {}
    for entry in entries:
        name, task, path = parse_entry(entry)
        out[name] = describe(Path(path), name, task)
    return out


class ZmqBackend:
    """The api.Backend over the pipeline connection: each Backend member is one connection call."""

    def __init__(self, config: Config, runtime: StageRuntime, model_info: dict[str, Any],
                 metrics: ServerMetrics | None = None, defaults: GenerationDefaults | None = None,
                 policies: AsyncPolicyClient | None = None) -> None:
        self.config = config
        self.policies = policies
        self.metrics = metrics or ServerMetrics()
        self.rt = runtime
        self.model_name = config.model.served_name
        self.max_model_len = int(model_info.get("max_model_len", 0))
        if defaults is None:  # the model's generation_config.json (vLLM's --generation-config)
            defaults = generation_defaults(config.model)
        self.sampling_defaults = defaults.sampling
        self.default_max_tokens = defaults.max_tokens or config.engine.default_max_tokens
        if defaults.source:
            log.info("OpenAI routes' sampling defaults from %s: %s%s", defaults.source, defaults.sampling,
                     f", max_tokens {defaults.max_tokens}" if defaults.max_tokens else "")
        self.max_n = config.engine.max_num_seqs
        self.pooling_models = pooling_infos(config.model.pooling)
        if not generates(config):  # model.path is the first pooling model: its length, not its config's
            self.max_model_len = self.pooling_models[self.model_name].max_len
        self.max_constraint_bytes = config.engine.max_constraint_bytes
        self.model_info = model_info
        self.identity = f"ingress-{os.getpid()}".encode()
        hwm = config.transport.hwm
        self.pipeline = Pipeline(runtime.addrs.router, identity=self.identity, ctx=runtime.ctx, hwm=hwm,
                                 hello_timeout_s=HELLO_TIMEOUT_S)
        self.pipeline.add_listener(self._on_control)
        self.training_in = zmq.asyncio.Socket.from_socket(
            open_socket(runtime.ctx, zmq.PULL, runtime.addrs.training, bind=True, hwm=hwm))
        self.training_decoder = protocol.Decoder(protocol.TrainingStatus)
        self.trainers: dict[str, protocol.TrainingStatus] = {}
        self.in_flight = 0             # generate() calls admitted and not yet ended (what a drain waits for)
        self.pause_answers = 0         # pause/resume answers received: a stats poll sent before one is older
        self.tasks: list[asyncio.Task] = []
        self.task_restarts: Counter[str] = Counter()  # background loops that failed and were restarted

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        try:
            await self.pipeline.connect()
        except ClientError as exc:
            raise RuntimeError(f"the detokenizer's router never answered Hello: {exc}") from None
        self.tasks = [asyncio.create_task(self._restarting(loop), name=f"ingress-{name}")
                      for name, loop in (("control", self._control), ("stats", self._poll_stats),
                                         ("training", self._read_training))]

    async def _restarting(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop forever: one that fails is logged, counted and started again, never
        left dead (a dead training reader would freeze /v1/training/status without a word)."""
        while True:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                self.task_restarts[loop.__name__] += 1
                log.exception("ingress background loop %s failed; restarting it", loop.__name__)
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await self.pipeline.close()
        if self.policies is not None:
            self.policies.close()

    @property
    def stages_down(self) -> set[str]:
        return self.pipeline.stages_down

    @property
    def last_batch_size(self) -> int:
        """The engine's decode batch size in the latest outputs (RL /generate metadata)."""
        return self.pipeline.last_batch_size

    # ------------------------------------------------------------------ background
    def _on_control(self, message: Any) -> None:
        """After the pipeline failed what a dead stage held: count it."""
        if isinstance(message, protocol.StageDown):
            self.metrics.stage_restarts.labels(message.stage).inc()
            if message.stage == "policy" and self.policies is not None:
                self.policies.fail_all(policy_down(message))
        if isinstance(message, (protocol.StageDown, protocol.StageUp)):
            self.metrics.stages_down.set(len(self.stages_down))

    async def _control(self) -> None:
        """Drain and shutdown flags from the supervisor, and this stage's heartbeat."""
        while True:
            self.rt.poll_control()
            self.rt.heartbeat(lambda: self.in_flight)
            await asyncio.sleep(0.05)

    async def _read_training(self) -> None:
        """Trainers' TrainingStatus pushes: kept (latest per trainer) for /v1/training/status and /metrics."""
        while True:
            frame = await self.training_in.recv()
            try:
                status = self.training_decoder.decode(frame)
            except protocol.ProtocolError as exc:
                self.metrics.dropped_frames["ingress"] += 1
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

    async def _poll_stats(self) -> None:
        """Engine and detokenizer stats for /metrics, /health and the queue bound, every STATS_PERIOD_S."""
        while True:
            for stage in ("engine", "detokenizer"):
                if f"{stage}-0" in self.stages_down:  # replica 0 answers (with the other engine replicas' stats)
                    continue
                answers = self.pause_answers
                try:
                    reply = await self.pipeline.call(stage, protocol.GetStats(qid=""), timeout=STATS_TIMEOUT_S)
                except ClientError:
                    continue
                if stage == "engine" and answers != self.pause_answers:  # the pause/resume answer is newer
                    reply.stats.paused = self.metrics.engine_stats.paused
                self.metrics.set_stats(reply.stats)
            if self.policies is not None and "policy-0" not in self.stages_down:
                await poll_policy_stats(self.policies, self.metrics)
            await asyncio.sleep(STATS_PERIOD_S)

    def _stage_missing(self) -> bool:
        """A stage every request needs is down (an engine replica is not while another one serves:
        the tokenizers route around it)."""
        engines_down = sum(1 for down in self.stages_down if down.startswith("engine-"))
        others = any(not down.startswith(("engine-", "policy-")) for down in self.stages_down)  # no LM request
        # passes the policy stage
        return others or engines_down >= replica_count(self.config.engine)

    @property
    def engine_waiting(self) -> int:
        """Sequences waiting in every engine replica."""
        stats = self.metrics.engine_stats
        return stats.waiting + sum(r.waiting for r in stats.replicas)

    def _queue_full(self) -> bool:
        bound = self.config.server.max_queued_requests
        return bool(bound) and self.engine_waiting >= bound

    # ------------------------------------------------------------------ Backend API
    async def generate(self, submit: protocol.TextSubmit) -> AsyncIterator[protocol.Output]:
        if self.rt.draining:
            raise BackendError(503, "shutting_down", "the server is shutting down", retryable=True)
        if self._stage_missing():
            self.metrics.rejected.labels("stage_down").inc()
            raise BackendError(503, "service_unavailable", "a stage is restarting; retry shortly", retryable=True)
        if self._queue_full():
            self.metrics.rejected.labels("queue_full").inc()
            raise BackendError(503, "queue_full", f"{self.engine_waiting} requests are already waiting for the "
                               "engine (server.max_queued_requests); retry shortly", retryable=True)
        submit.spec.submitted_at = submit.spec.submitted_at or time.time()
        timings = _Timings(self.metrics)
        try:
            stream = await self.pipeline.open(submit, block=False)
        except ClientError as exc:
            raise backend_error(exc) from None
        self.in_flight += 1
        coalesce = self.config.server.coalesce_outputs
        try:
            while items := await stream.batch():
                for item in items:
                    timings.observe(item)
                for item in protocol.coalesce_outputs(items) if coalesce and len(items) > 1 else items:
                    yield item
        except ClientError as exc:
            raise backend_error(exc) from None
        finally:
            self.in_flight -= 1
            stream.close()

    async def _ask(self, target: str, message: Any) -> Any:
        """A control request to `target` and its reply (a RequestError answer or no answer raises)."""
        try:
            return await self.pipeline.call(target, message, timeout=QUERY_TIMEOUT_S)  # type: ignore[arg-type]
        except ClientError as exc:
            raise backend_error(exc) from None

    async def engine_stats(self) -> protocol.EngineStats:
        return (await self._ask("engine", protocol.GetStats(qid=""))).stats

    async def pause(self, mode: str) -> protocol.PauseState:
        return self._paused(await self._ask("engine", protocol.Pause(mode=mode)))

    async def resume(self) -> protocol.PauseState:
        return self._paused(await self._ask("engine", protocol.Resume()))

    def _paused(self, state: protocol.PauseState) -> protocol.PauseState:
        """/health follows the engine's answer at once, not the next stats poll (it said `paused` for up to
        STATS_PERIOD_S after a successful resume)."""
        self.pause_answers += 1
        self.metrics.engine_stats.paused = state.paused
        return state

    async def abort(self, rids: list[str], *, all: bool = False) -> None:
        self.pipeline.abort(rids, all=all)

    async def load_adapter(self, request: protocol.AdapterPublish) -> protocol.AdapterLoaded:
        return await self._ask("engine", request)

    async def update_weights(self, request: protocol.WeightsUpdate) -> protocol.WeightsUpdated:
        try:  # reading a checkpoint from disk takes longer than a control query
            return await self.pipeline.call("engine", request, timeout=WEIGHTS_TIMEOUT_S)  # type: ignore[arg-type]
        except ClientError as exc:
            raise backend_error(exc) from None

    async def reset_prefix_cache(self) -> protocol.PrefixCacheReset:
        return await self._ask("engine", protocol.ResetPrefixCache())

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
        in_flight = self.in_flight
        stats_age = time.monotonic() - self.metrics.engine_stats_at if self.metrics.engine_stats_at else 0.0
        engines = [self.metrics.engine_stats, *self.metrics.engine_stats.replicas]
        pressure = max((e.kv_pressure for e in engines), key=PRESSURE_ORDER.index)
        if self.rt.draining:
            status = "shutting_down"
        elif self.stages_down:
            status = "degraded"
        elif self.metrics.engine_stats.paused:
            status = "paused"
        elif stats_age > ENGINE_STALLED_AFTER_S:  # its loop answers no stats poll: stuck in one step
            status = "stalled"
        elif (limit and in_flight >= limit) or self._queue_full() or pressure == "overloaded":
            status = "overloaded"
        elif pressure == "degraded":  # near kv.pressure_threshold: serving, not ready for more
            status = "degraded"
        else:
            status = "ok"
        serving = status in ("ok", "overloaded") or (status == "degraded" and not self.stages_down)
        state = {"status": status, "ready": status == "ok", "serving": serving,
                 "stages_down": sorted(self.stages_down), "in_flight": in_flight, "waiting": self.engine_waiting,
                 "running": sum(e.running for e in engines)}
        if self.config.kv.pressure_threshold is not None:
            state["kv_utilization"] = round(max(e.kv_utilization for e in engines), 4)
            state["kv_demand"] = round(max(e.kv_demand for e in engines), 4)
        return state


async def poll_policy_stats(policies: AsyncPolicyClient, metrics: ServerMetrics) -> None:
    """The policy stage's stats into /metrics (nothing when it does not answer in time)."""
    try:
        metrics.set_stats(await asyncio.wait_for(policies.stats(), STATS_TIMEOUT_S))
    except (ClientError, asyncio.TimeoutError):
        pass


def policy_down(message: protocol.StageDown) -> protocol.RequestError:
    """What a policy request in flight gets when the policy stage dies (retryable)."""
    return protocol.RequestError(rid="", status=503, code="stage_down", retryable=True,
                                 message=f"the policy stage died (restart {message.restarts}); retry the request")


class PolicyOnlyBackend:
    """The backend of a server that serves policies and no language model: health and the supervisor's
    control messages (drain, shutdown, the policy stage's death and return)."""

    def __init__(self, config: Config, runtime: StageRuntime, policies: AsyncPolicyClient,
                 metrics: ServerMetrics) -> None:
        self.config = config
        self.rt = runtime
        self.policies = policies
        self.metrics = metrics
        self.stages_down: set[str] = set()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self._control(), name="ingress-control"),
                      asyncio.create_task(self._poll_stats(), name="ingress-stats")]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.policies.close()

    async def _poll_stats(self) -> None:
        while True:
            if "policy-0" not in self.stages_down:
                await poll_policy_stats(self.policies, self.metrics)
            await asyncio.sleep(STATS_PERIOD_S)

    async def _control(self) -> None:
        while True:
            for message in self.rt.poll_control():
                if isinstance(message, protocol.StageDown):
                    self.stages_down.add(f"{message.stage}-{message.replica}")
                    self.metrics.stage_restarts.labels(message.stage).inc()
                    if message.stage == "policy":
                        self.policies.fail_all(policy_down(message))
                elif isinstance(message, protocol.StageUp):
                    self.stages_down.discard(f"{message.stage}-{message.replica}")
                self.metrics.stages_down.set(len(self.stages_down))
            self.rt.heartbeat(lambda: self.policies.in_flight)
            await asyncio.sleep(0.05)

    def health(self) -> dict[str, Any]:
        limit = self.config.server.max_concurrent_requests
        in_flight = self.policies.in_flight
        status = ("shutting_down" if self.rt.draining else "degraded" if self.stages_down else
                  "overloaded" if limit and in_flight >= limit else "ok")
        return {"status": status, "ready": status == "ok", "stages_down": sorted(self.stages_down),
                "in_flight": in_flight}


def main(config: Config, replica: int = 0) -> int:
    import uvicorn

    runtime = StageRuntime(config, "ingress", replica)
    metrics = ServerMetrics()
    policies = AsyncPolicyClient(runtime.addrs.policy, ctx=runtime.ctx, timeout=QUERY_TIMEOUT_S) \
        if config.policies.models else None
    backend: Any
    if serves_lm(config):
        from parallm.text.loading import model_limits

        info = model_limits(config.model)
        try:
            defaults = generation_defaults(config.model)
        except ValueError as exc:
            runtime.fatal(f"cannot read the model's sampling defaults: {exc}")
            return 2
        backend = ZmqBackend(config, runtime, info, metrics, defaults, policies)
        app = build_app(backend, config.server, metrics, policies, generates=generates(config))
    else:
        assert policies is not None  # config._check: a server serves a model or policies
        backend = PolicyOnlyBackend(config, runtime, policies, metrics)
        app = build_policy_app(backend, policies, config.server, metrics)

    from parallm.api.strict_http import strict_protocol

    server_config = uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                   loop="uvloop" if _has_uvloop() else "asyncio", log_level="warning",
                                   http=strict_protocol(config.server.header_timeout_s, config.server.body_timeout_s),
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

    profile = os.environ.get("PARALLM_PROFILE_INGRESS", "")  # perf/bench_ingress.py --profile
    profiler = None
    if profile:  # written at exit and on SIGUSR2 (a stage may be killed before its exit)
        import cProfile
        import signal

        profiler = cProfile.Profile(time.process_time)  # CPU time: the machine may be shared
        signal.signal(signal.SIGUSR2, lambda *_: profiler.dump_stats(profile))
        profiler.enable()
    try:
        if _has_uvloop():
            import uvloop

            uvloop.run(serve())
        else:
            asyncio.run(serve())
    except OSError as exc:
        runtime.fatal(f"cannot serve HTTP on {config.server.host}:{config.server.port}: {exc}")
        return 2
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
    return 0


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
