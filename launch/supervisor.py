"""The supervisor: starts the stages, watches them, restarts the dead, drains on SIGTERM.

The stages behind ingress (detokenizer, engine replicas, tokenizers) start together, since none
needs another to load; ingress starts once each of them has reported READY, so that by the time
HTTP is served every stage behind it is up; the trainer, when configured, starts last. Starting
them together puts the tokenizer and detokenizer imports beside the engine's model load instead of
after it. A stage that dies
(or stops heartbeating) is announced on the control channel (StageDown) so that ingress and
clients fail its in-flight requests with a retryable error, then restarted with exponential
backoff and announced again when READY (StageUp).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import IO

import msgspec
import zmq

from parallm import protocol
from parallm.config import Config, enabled_trainers, generates, pooling_only_problems, serves_lm
from parallm.keys import CurveKeyError, stage_curve, supervisor_keys
from parallm.logs import write_line
from parallm.transport import Receiver, Sender, addresses, open_socket, set_curve, stop_authenticators

from .group import Followers, HostfileError, RemoteReplicas, place_ranks
from .process import StageProcess, StageSpec
from .rundir import RunDir

log = logging.getLogger("parallm.supervisor")

# Stages started together (each wave once the one before it is READY)
START_WAVES = (("detokenizer", "engine", "tokenizer", "policy"), ("ingress",), ("trainer",))
# Stages no request passes through: their death fails nothing in flight, so it is not announced,
# and one that exits with 0 has finished its work and is not restarted.
OFF_PATH = frozenset({"trainer"})
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0


class StartupError(RuntimeError):
    """A stage could not start; the message says why."""


def engine_environment(config: Config) -> dict[str, str]:
    """The engine's environment: OpenBLAS (and mimalloc) preloaded on Linux when MLX computes on the CPU."""
    env = dict(os.environ)
    choice = config.supervisor.blas
    if choice == "none" or not sys.platform.startswith("linux"):
        return env
    from parallm import blas

    if choice is None:
        import mlx.core as mx

        if mx.default_device() != mx.cpu:
            return env
    allocator = config.supervisor.allocator
    if allocator == "mimalloc":  # an explicit choice outranks PARALLM_NO_MIMALLOC
        if blas.find_mimalloc() is None:
            raise StartupError("supervisor.allocator=mimalloc but the cmeel-mimalloc package is not installed "
                               "(pip install cmeel-mimalloc)")
        env.pop(blas.NO_MIMALLOC, None)
    preloaded = blas.openblas_env(env, allocator=allocator != "system")
    if preloaded is None:
        if choice == "openblas":
            raise StartupError("supervisor.blas=openblas but the cmeel-openblas package is not installed "
                               "(pip install cmeel-openblas)")
        log.warning("MLX runs on the CPU with its reference BLAS; install cmeel-openblas for 15-60x "
                    "faster matmuls")
        return env
    log.info("engine preloads %s", preloaded["LD_PRELOAD"])
    return preloaded


def gpu_host() -> bool:
    import mlx.core as mx

    return mx.cuda.is_available()


class Supervisor:
    def __init__(self, config: Config, *, log_out: IO[str] | None = None) -> None:
        self.config = config
        self.log_out = log_out or sys.stderr
        self.stages: list[StageProcess] = []
        self._run_dir: RunDir | None = None
        self._stop_requested = 0
        self._draining_until: float | None = None
        self.groups: dict[int, Followers] = {}  # engine replica -> its ranks > 0 (engine.tensor_parallel > 1)
        self.remotes = RemoteReplicas(config.engine.replicas, len(config.engine.remote_replicas))

    # ------------------------------------------------------------------ setup
    def _prepare(self) -> None:
        transport = self.config.transport
        try:
            self._run_dir = RunDir(transport.run_dir)
        except OSError as exc:
            raise StartupError(f"cannot use run dir {transport.run_dir!r}: {exc}") from None
        model = self._resolve_model() if serves_lm(self.config) else self.config.model
        transport = msgspec.structs.replace(transport, run_dir=self._run_dir.path,
                                            curve_keys=self._curve_keys(transport, self._run_dir.path))
        self.config = msgspec.structs.replace(self.config, transport=transport, model=model)
        set_curve(stage_curve(transport.curve_keys))
        self.run_dir = self._run_dir.path
        self.config_bytes = self.config.encode()  # handed to each stage through a pipe: no secret on disk
        self.addrs = addresses(self.config)

    @staticmethod
    def _curve_keys(transport, run_dir: str) -> list[str]:
        """Over tcp, the CURVE keys the stages use (parallm/keys.py); none for ipc (the run dir is private)."""
        if transport.kind != "tcp":
            return []
        if not transport.curve:
            log.warning("transport.curve is off: any process that reaches %s may publish adapters, pause the "
                        "engine and read prompts", transport.tcp_host)
            return []
        try:
            return supervisor_keys(transport.curve_server_key, transport.curve_clients, run_dir)
        except CurveKeyError as exc:
            raise StartupError(str(exc)) from None

    def _resolve_model(self):
        """Convert/locate the model once here (with progress), so stages load a ready directory. A pooling
        model as model.path (model.task, or auto and its directory says so) is served with no generator:
        its entry leads model.pooling and model.task names its task."""
        from parallm.models import ModelLoadError, resolve_model
        from parallm.pooling.load import resolve_entries, resolve_served_model

        model = self.config.model
        try:
            served = resolve_served_model(model, model.cache_dir)
            source = resolve_model(model, progress=True) if served is None else None
            pooling = resolve_entries(model.pooling, model.cache_dir)
        except ModelLoadError as exc:
            raise StartupError(f"cannot load model {model.path!r}: {exc}") from None
        except ValueError as exc:
            raise StartupError(f"cannot serve model.pooling: {exc}") from None
        if source is not None:
            return msgspec.structs.replace(model, path=str(source.path), pooling=pooling, task="generate",
                                           served_name=model.served_name or source.name)
        entry, task = served
        name, path = entry.partition(":")[0], entry.partition("=")[2]
        resolved = msgspec.structs.replace(model, path=path, pooling=[entry, *pooling], task=task, served_name=name)
        problems = pooling_only_problems(msgspec.structs.replace(self.config, model=resolved))
        if any(other.partition(":")[0] == name for other in pooling):
            problems.append(f"model.pooling names '{name}' too")
        if problems:
            raise StartupError(f"cannot serve {model.path!r} as a pooling model: {'; '.join(problems)}")
        return resolved

    def _specs(self) -> list[StageSpec]:
        """The stages to run: the language model's (unless only policies are served), the policy stage
        (with policies.models), ingress, and the trainer when enabled."""
        specs = self._lm_specs() if serves_lm(self.config) else []
        if self.config.policies.models:  # its forwards are matmuls too: the engine's BLAS
            specs.append(StageSpec("policy", env=engine_environment(self.config)))
        specs.append(StageSpec("ingress"))
        trainers = enabled_trainers(self.config)
        if trainers:  # one stage per trainer ([trainer] and each [[trainer]] entry), replica = its index
            from parallm import blas

            env = blas.beside_engine_env(engine_environment(self.config), share=len(trainers))
            specs += [StageSpec("trainer", replica=i, env=env) for i in range(len(trainers))]
        return specs

    def _lm_specs(self) -> list[StageSpec]:
        engine_env = engine_environment(self.config)
        specs = [StageSpec("detokenizer")]
        tp, replicas = self.config.engine.tensor_parallel, self.config.engine.replicas
        for replica in range(replicas):
            env = engine_env
            if replicas > 1 and tp == 1 and gpu_host():
                env = {**engine_env, "CUDA_VISIBLE_DEVICES": str(replica)}  # one GPU per replica
            specs.append(StageSpec("engine", replica=replica, env=env))
            if tp > 1:
                from parallm.engine.distributed import default_backend

                try:  # engine.hostfile: where each rank runs (ranks on other machines start over ssh)
                    hosts = place_ranks(self.config, tp)
                except HostfileError as exc:
                    raise StartupError(str(exc)) from None
                self.groups[replica] = Followers(tp, replica, env, self.run_dir, default_backend(), hosts=hosts)
        specs += [StageSpec("tokenizer", replica=i) for i in range(self.config.tokenizer.replicas)]
        return specs

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        try:
            self._prepare()
        except StartupError as exc:
            write_line(f"parallm-launch: {exc}")
            if self._run_dir is not None:
                self._run_dir.close()
            return 2
        self.ctx = zmq.Context()
        self.inbox = Receiver(open_socket(self.ctx, zmq.PULL, self.addrs.supervisor, bind=True),
                              protocol.SupervisorInbound, name="supervisor")
        self.control = Sender(open_socket(self.ctx, zmq.PUB, self.addrs.control, bind=True))
        self._parent_read, self._parent_write = os.pipe()
        old_handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.stages = [StageProcess(spec) for spec in self._specs()]
            for names in START_WAVES:
                self._start_and_wait([s for s in self.stages if s.spec.name in names])
            server = self.config.server
            log.info("serving %s on http://%s:%d", self._served(), server.host, server.port)
            self._print_ready()
            return self._monitor()
        except StartupError as exc:
            write_line(f"parallm-launch: {exc}")
            return 3
        finally:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self._stop_all()

    def _print_ready(self) -> None:
        """The line that tells a person (or a script waiting for it) that the server serves; with JSON
        logs, a JSON line holding the same text."""
        server = self.config.server
        zmq = [f"engine {self.addrs.engine}", f"router {self.addrs.router}"] if serves_lm(self.config) else []
        if self.config.policies.models:
            zmq += [f"policy {self.addrs.policy}", f"policy weights {self.addrs.policy_weights}"]
        line = (f"parallm-launch: ready: {self._served()} at http://{server.host}:{server.port}/v1 "
                f"(zmq {', '.join(zmq)}{self._curve_note()})")
        if self.config.log_format == "json":
            line = json.dumps({"level": "info", "stage": "supervisor", "logger": "parallm.supervisor", "message": line,
                               "url": f"http://{server.host}:{server.port}/v1", "router": self.addrs.router,
                               "policy": self.addrs.policy})
        write_line(line, self.log_out)

    def _served(self) -> str:
        """What the ready line names: the model and the policies."""
        model = self.config.model
        names = [f"model {model.served_name}" + ("" if generates(self.config) else f" ({model.task}, no generator)")] \
            if serves_lm(self.config) else []
        policies = [entry.partition("=")[0] for entry in self.config.policies.models]
        return ", ".join(names + ([f"policies {', '.join(policies)}"] if policies else []))

    def _curve_note(self) -> str:
        """Where a raw client finds the server's CURVE public key (tcp only)."""
        transport = self.config.transport
        if not transport.curve_keys:
            return ""
        given = transport.curve_server_key
        public = given.removesuffix("_secret") if os.path.isfile(given.removesuffix("_secret")) else given
        public = public or os.path.join(self.run_dir, "server.key")
        return f", CURVE server key {public}"

    def _on_signal(self, signum: int, frame) -> None:
        self._stop_requested += 1

    def _launch(self, stage: StageProcess) -> None:
        """Start a stage; an engine that is a tensor-parallel group starts as all of its ranks."""
        group = self.groups.get(stage.spec.replica) if stage.spec.name == "engine" else None
        if group is not None:
            stage.spec.env = group.prepare()
        json_logs = self.config.log_format == "json"
        stage.start(self.config_bytes, self._parent_read, self.log_out, json_logs)
        if group is not None:
            group.start(self.config_bytes, self._parent_read, self.log_out, json_logs)

    def _alive(self, stage: StageProcess) -> bool:
        """The stage's process runs (for a tensor-parallel engine: every rank's)."""
        group = self.groups.get(stage.spec.replica) if stage.spec.name == "engine" else None
        rank = group.dead() if group is not None else None
        if rank is not None:
            log.error("%s rank %d exited with code %s: the group restarts", stage.spec.label, rank,
                      group.exit_code(rank))
            return False
        return stage.alive()

    def _start_and_wait(self, stages: list[StageProcess]) -> None:
        """Launch `stages` at once and wait until every one has reported READY."""
        for stage in stages:
            self._launch(stage)
        deadline = time.monotonic() + self.config.supervisor.ready_timeout_s
        waiting = list(stages)
        while waiting:
            if time.monotonic() > deadline:
                raise StartupError(f"stage {waiting[0].spec.label} did not report READY within "
                                   f"{self.config.supervisor.ready_timeout_s:.0f} s")
            if self._stop_requested:
                raise StartupError("interrupted during startup")
            message = self.inbox.recv(timeout_ms=100)
            if message is not None:
                self._handle(message)
            for stage in waiting:
                if not stage.ready and not self._alive(stage):
                    raise StartupError(f"stage {stage.spec.label} exited with code {stage.exit_code()} during "
                                       "startup (its log is above)")
            waiting = [stage for stage in waiting if not stage.ready]

    def _find(self, name: str, replica: int) -> StageProcess | None:
        return next((s for s in self.stages if s.spec.name == name and s.spec.replica == replica), None)

    def _handle(self, message) -> None:
        """A message from a stage: believed only from the process the supervisor started for it."""
        stage = self._find(message.stage, message.replica)
        if stage is None and self.remotes.hear(message, time.monotonic()):  # an engine replica started elsewhere
            return
        if stage is None or stage.proc is None or message.pid != stage.pid:
            log.warning("ignored a %s claiming to be %s %d from pid %d", type(message).__name__, message.stage,
                        message.replica, message.pid)
            return
        now = time.monotonic()
        stage.last_beat = now
        if isinstance(message, protocol.Ready):
            stage.ready = True
            if stage.restarts and stage.spec.name not in OFF_PATH:
                log.info("%s is back (restart %d)", stage.spec.label, stage.restarts)
                self.control.send(protocol.StageUp(stage=stage.spec.name, replica=stage.spec.replica,
                                                   restarts=stage.restarts))
        elif isinstance(message, protocol.Heartbeat):
            stage.loop_age_s, stage.in_flight = message.loop_age_s, message.in_flight
            stage.heard_step(message.step_age_s, message.step_deadline_s, now)
        elif isinstance(message, protocol.Fatal):
            if not stage.ready and stage.restarts == 0:
                raise StartupError(f"{stage.spec.label}: {message.message}")
            log.error("%s reported a fatal error: %s", stage.spec.label, message.message)

    def _monitor(self) -> int:
        sup = self.config.supervisor
        while True:
            if self._stop_requested and self._draining_until is None:
                self._begin_drain()
            if self._draining_until is not None and (self._drained() or time.monotonic() > self._draining_until
                                                     or self._stop_requested > 1):
                log.info("drained; shutting down")
                return 0
            message = self.inbox.recv(timeout_ms=100)
            while message is not None:
                try:
                    self._handle(message)
                except Exception:  # noqa: BLE001 - no message may stop the supervisor
                    log.exception("could not handle a %s", type(message).__name__)
                message = next(self.inbox.drain(1), None)
            now = time.monotonic()
            for announcement in self.remotes.check(now, sup.dead_after_s):
                self.control.send(announcement)
            for stage in self.stages:
                if stage.finished:
                    continue
                if stage.proc is None:
                    if now >= stage.next_restart_at and self._draining_until is None:
                        self._restart(stage)
                    continue
                dead = not self._alive(stage)
                if dead and stage.spec.name in OFF_PATH and stage.exit_code() == 0:
                    log.info("%s finished", stage.spec.label)
                    stage.finished = True
                    continue
                silent = stage.ready and now - stage.last_beat > sup.dead_after_s
                stalled = stage.ready and sup.stall_after_s > 0 and stage.loop_age_s > sup.stall_after_s
                slow_start = not stage.ready and now - stage.started_at > sup.ready_timeout_s
                hung = stage.ready and stage.overdue_s(now) > 0  # an engine step outlived its deadline
                if dead or silent or stalled or slow_start or hung:
                    why = (f"exited with code {stage.exit_code()}" if dead else
                           f"is hung: its step ran past its {stage.step_deadline_s:.1f} s deadline (the engine, or "
                           "a rank of its group, makes no progress; engine.hang_floor_s)" if hung else
                           f"silent for {now - stage.last_beat:.1f} s" if silent else
                           f"stuck in one loop iteration for {stage.loop_age_s:.0f} s" if stalled else
                           "never became ready")
                    self._declare_dead(stage, why)

    def _declare_dead(self, stage: StageProcess, why: str) -> None:
        log.error("%s %s; restarting", stage.spec.label, why)
        stage.kill()
        if stage.spec.name == "engine" and stage.spec.replica in self.groups:
            self.groups[stage.spec.replica].kill()
        stage.proc = None
        stage.ready = False
        now = time.monotonic()
        if now - stage.started_at > STABLE_AFTER_S:
            stage.backoff = 0.0
        stage.backoff = min(MAX_BACKOFF_S, stage.backoff * 2 if stage.backoff else
                            self.config.supervisor.restart_backoff_s)
        stage.next_restart_at = now + stage.backoff
        stage.restarts += 1
        if stage.spec.name in OFF_PATH:
            return
        self.control.send(protocol.StageDown(stage=stage.spec.name, replica=stage.spec.replica,
                                             restarts=stage.restarts))

    def _restart(self, stage: StageProcess) -> None:
        log.info("starting %s again (restart %d)", stage.spec.label, stage.restarts)
        self._launch(stage)

    # ------------------------------------------------------------------ drain / stop
    def _begin_drain(self) -> None:
        timeout = self.config.supervisor.drain_timeout_s
        log.info("draining: no new requests; in-flight ones get %.0f s", timeout)
        self._draining_until = time.monotonic() + timeout
        self.control.send(protocol.Drain(deadline=time.time() + timeout))
        self._drain_started = time.monotonic()

    def _drained(self) -> bool:
        # give stages a heartbeat to report post-drain state before trusting their counts
        if time.monotonic() - self._drain_started < 2 * self.config.supervisor.heartbeat_s:
            return False
        ingress = [s for s in self.stages if s.spec.name == "ingress"]
        detok = [s for s in self.stages if s.spec.name in ("detokenizer", "policy")]
        busy = sum(s.in_flight for s in ingress + detok if s.alive())
        return busy == 0

    def _stop_all(self) -> None:
        if not hasattr(self, "control"):
            return
        try:
            self.control.send(protocol.Shutdown())
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + 5.0
        for stage in reversed(self.stages):
            stage.terminate(max(0.1, deadline - time.monotonic()))
        for group in self.groups.values():  # rank 0 told them to stop as it exited
            group.terminate(max(0.1, deadline - time.monotonic()))
        os.close(self._parent_write)
        os.close(self._parent_read)
        self.inbox.close()
        self.control.close()
        stop_authenticators()
        self.ctx.term()
        if self._run_dir is not None:
            self._run_dir.close()
