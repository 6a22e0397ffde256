"""Tensor parallelism: one engine as a group of ranks over MLX's own distributed layer.

Every rank loads the model, shards it with mlx-lm's `model.shard(group)` (each rank keeps a slice
of the attention heads and MLP columns; the layers' `sharded-to-all` projections all-sum their
outputs) and builds the same `Engine`. Rank 0 serves: the engine stage wraps its engine in a
`Leader`, which records every call that changes the engine's state (a request added, an abort,
an adapter loaded or made the default, the prefix cache dropped, a step, ...) and, before each step,
sends the calls since the last one to the other ranks as one numbered `RankBatch` (the step's plan:
parallm/protocol/to_ranks.py, one tagged struct per call) over ZeroMQ (an XPUB socket in the run
dir). The Leader answers exactly the engine calls the stage makes, each written out (no
`__getattr__`, no proxies of the engine's parts): a state-changing call the stage starts making
fails on the Leader until it is a recorded struct (tests/test_distributed.py checks the stage's
calls against it). The other ranks
run `follow`: they replay the same calls on their own engine, so every rank schedules the same plan
and runs the same passes in lockstep (the passes' own all-sums, in mlx-lm's sharded layers, keep
them in step: those stay on `mx.distributed`). The scheduler's clock (priority aging) is rank 0's,
sent with each call.

Sampling runs on every rank, on the same logits: the all-sum leaves identical logits on every
rank, and a row's sampler is seeded by its request, so each rank draws the same tokens without a
per-step exchange of them (what mlx-lm's server does too); only rank 0's outputs leave the
process. Each batch carries a digest of rank 0's state after its previous step, which a follower
compares with its own (a rank that diverged exits), and each follower sends its digest after each
batch back to rank 0 (`RankAck`, over a PUSH socket to rank 0's PULL), which drains what arrived
without waiting before each step: a digest that differs from rank 0's at that batch, or a follower
that has not answered a batch for SILENT_AFTER_S, ends the group (rank 0 raises, the supervisor
restarts every rank); a gap in the batch numbers ends a follower.

Why not a collective for the calls (as before): an all-sum on the default stream queues behind the
pass rank 0 launched last step, and reading its result back on the host waits for that pass, so
the engine's overlapped schedule (launch pass N+1 before reading pass N) was lost and each step
cost the GPU time plus every rank's CPU time in series (on two H200s, Llama-3.2-3B shape: TP=2
gave 0.20x one engine at 64 streams). Sending bytes over ZeroMQ touches no device. It also makes the
old doorbell unnecessary: an idle follower blocks in a ZeroMQ receive (no core burned, unlike a
rank waiting in a ring collective, which polls), so `Leader.idle` only drains the acks.

The channel is ipc in the run dir while every rank runs on this machine; when engine.hostfile puts a
rank on another machine (the supervisor starts it over ssh: launch/remote_rank.py) it is tcp:// at
rank 0's hostfile address, on ports the supervisor picks for each start and hands every rank in
CONTROL_ENV, with CURVE (the stages' keys, parallm/keys.py: rank 0 binds as the server, the others
connect with the stage pair it admits). GPU check of this design (perf/bench_parallel.py):
`python -m perf.bench_parallel --shape llama-3.2-3b --layouts 1x1,2x1 --concurrency 1,64 --max-tokens 128`
on nvidia-h100-x2 (NCCL_NVLS_ENABLE=0).

Nothing here waits forever on its own: a dead rank ends the group's collectives with an error or
leaves them blocked, and the supervisor, which watches every rank's process and rank 0's
heartbeats, kills and restarts the whole group (docs/operations.md, "More than one device"). A rank
that hangs alive leaves rank 0 inside a step: rank 0 gives every step a deadline from the group's own
recent steps (step_deadline.py), its heartbeat carries the step's age and deadline, and the supervisor
restarts the group once the step outlives it.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any, Callable, Mapping, Protocol

import mlx.core as mx
import zmq

from parallm.adapters import load_bytes, save_bytes
from parallm import protocol
from parallm.protocol import (AbortRequest, AddRequest, AddScore, DropCachedBlocks, Flush, FollowLatest, LoadAdapter,
                              RankAck, RankBatch, RankCall, RankState, SetDefaultAdapter, Step, StopFollowing,
                              UnloadAdapter, UpdateWeights)

from .rank_group import (  # noqa: F401 - re-exported: the engine stage and tests use distributed.<name>
    CONTROL_ENV, TensorParallelError, agree_min, agreed_config, channel_socket, control_addresses, default_backend,
    join, rank_from_env, shard_model, shard_refusal)
from .constraints import Constraints
from .rank_timing import RankPhases, probe_collectives
from .request import Request, RequestRejected
from .step_deadline import StepDeadline, step_kind_and_work

log = logging.getLogger("parallm.engine.distributed")

CONNECT_WAIT_S = 60  # for every follower to subscribe to rank 0's calls
SILENT_AFTER_S = 60.0  # a follower that has not acknowledged a batch for this long ends the group
ACK_GRACE_S = 2.0  # waited for a late ack before that (rank 0 may itself have been blocked, e.g. in a weight load)


_batches = protocol.Decoder(protocol.RankBatch)
_acks = protocol.Decoder(protocol.RankAck)


class AdapterReads(Protocol):
    """What rank 0's stage reads of the loaded adapters (its changes are Leader calls, replayed everywhere)."""

    default_name: str

    def describe(self) -> list[protocol.AdapterInfo]: ...

    @property
    def nbytes(self) -> int: ...


class BlockReads(Protocol):
    """What rank 0's stage reads of the prefix cache."""

    @property
    def num_used(self) -> int: ...


class WeightChecks(Protocol):
    """A weight-update chunk checked before it is staged (nothing applied: no rank hears of it)."""

    def check_chunk(self, tensors: Mapping[str, mx.array]) -> None: ...


def served_policy(engine) -> dict[str, int]:
    """{adapter: latest version} and, under "", the base weights' version."""
    return {**engine.policy(), "": engine.weights_version}


def state_digest(engine) -> int:
    """A cheap fingerprint of what the scheduler decided so far and of the adapter versions and base
    weights each rank serves: equal on ranks that agree (strings by crc32: hash() of a str differs
    between processes)."""
    s = engine.scheduler
    key = (engine.steps, len(s.waiting), tuple((q.seq_id, q.num_computed, q.num_tokens) for q in s.running),
           tuple((q.seq_id, q.num_computed) for q in s.prefilling), engine.weights_version,
           zlib.crc32(repr((sorted(engine.policy().items()), engine.adapters.default_name)).encode()))
    return hash(key) & 0x7FFFFFFFFFFFFFFF


def lead(engine, model, group: mx.distributed.Group, addresses: tuple[str, str], warm_up_s: float = 0.0) -> "Leader":
    """Rank 0 after its warm-up (`warm_up_s`: how long it took): the all-sum probe (in lockstep with
    follower_main's, which runs it after the same warm-up), then the Leader that serves."""
    return Leader(engine, group, addresses, probe_collectives(model, group), warm_up_s=warm_up_s)


class Leader:
    """Rank 0's engine: the real `Engine`, with every state-changing call recorded and sent to the
    other ranks before each step (module docstring). Reads (stats, has_work, ...) pass through."""

    def __init__(self, engine, group: mx.distributed.Group, addresses: tuple[str, str],
                 collective_us: dict[str, float] | None = None, warm_up_s: float = 0.0) -> None:
        """`addresses`: where to send the calls and hear the followers' acks (control_addresses);
        `collective_us`: this rank's probe_collectives, for its stats; `warm_up_s`: how long the
        warm-up took (the first step's allowance for what MLX builds on first use, step_deadline.py)."""
        self._engine = engine
        self._group = group
        self._calls = channel_socket(zmq.XPUB, addresses[0], bind=True)  # never drops a batch for a slow follower
        self._calls.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._acks = channel_socket(zmq.PULL, addresses[1], bind=True)
        for _ in range(group.size() - 1):  # every other rank subscribes before the first batch
            if not self._calls.poll(CONNECT_WAIT_S * 1000):
                self.close_sockets()
                raise TensorParallelError(f"the other ranks did not connect to {addresses[0]} within "
                                          f"{CONNECT_WAIT_S} s")
            self._calls.recv()
        self._seq = 0
        self._sent: dict[int, float] = {}  # batch -> when it was sent, until every follower acked it
        self._after: dict[int, tuple[int, int, dict[str, int]]] = {}  # batch -> rank 0's (digest, steps, policy)
        self._acked = {r: 0 for r in range(1, group.size())}
        self._pending: list[RankCall] = []
        self._now = time.monotonic()
        self._digest = state_digest(engine)
        self._digest_policy = served_policy(engine)  # what rank 0 served when it computed _digest
        self._ranks = [RankState(rank=r, policy=self._digest_policy) for r in range(group.size())]
        self._times = RankPhases("plan")  # rank 0's plan phase (rank_timing.py)
        self._collective_us = collective_us or {}
        self._rank_times: dict[int, tuple[dict[str, float], dict[str, float]]] = {}  # follower -> its last timings
        settings = engine.config
        self.deadline = StepDeadline(settings.hang_floor_s, settings.hang_factor, warm_up_s)  # a hung rank's bound
        engine.scheduler.policy.clock = lambda: self._now
        engine.pacer.learning = True

    @property
    def group(self) -> mx.distributed.Group:
        return self._group

    # reads: what the engine stage asks of rank 0's engine; they change nothing, so no rank hears of them
    # (no __getattr__: a state-changing call the stage starts making fails here, loudly, until it is recorded)
    def request_ids(self) -> list[str]:
        return self._engine.request_ids()

    def has_work(self) -> bool:
        return self._engine.has_work()

    def owes_outputs(self) -> bool:
        return self._engine.owes_outputs()

    def check_integrity(self) -> None:
        self._engine.check_integrity()

    def policy(self) -> dict[str, int]:
        return self._engine.policy()

    @property
    def last_batch_size(self) -> int:
        return self._engine.last_batch_size

    @property
    def steps(self) -> int:
        return self._engine.steps

    @property
    def weights_version(self) -> int:
        return self._engine.weights_version

    @property
    def weights(self) -> WeightChecks:
        """Checks a chunk of a weight update before it is applied (check_chunk)."""
        return self._engine.weights

    @property
    def constraints(self) -> Constraints:
        """Grammar compilation (on the stage's compile thread); a compiled grammar is used by the
        requests that carry it, which every rank gets in AddRequest."""
        return self._engine.constraints

    @property
    def adapters(self) -> AdapterReads:
        """The loaded adapters, to describe; the default is set with set_default_adapter."""
        return self._engine.adapters

    @property
    def blocks(self) -> BlockReads | None:
        """The prefix cache, to count; dropped with drop_cached_blocks."""
        return self._engine.blocks

    def _record(self, call: RankCall, run: Callable[[], Any]) -> Any:
        """Run the call here; if it raised nothing, queue it (stamped with rank 0's clock) for the others."""
        self._now = call.now = time.monotonic()
        t0 = time.perf_counter()
        try:
            result = run()
        finally:  # the others replay it before the next step's collectives: that step waits as long
            self.deadline.replayed(time.perf_counter() - t0)
        self._pending.append(call)
        return result

    def _send(self, *calls: RankCall) -> None:
        """Send the pending calls and `calls` as the next batch; no device work, no wait."""
        self._drain_acks()
        self._pending.extend(calls)
        self._seq += 1
        batch, self._pending = RankBatch(calls=self._pending, digest=self._digest, seq=self._seq), []
        self._calls.send(protocol.encode(batch))
        if self._acked:
            self._sent[self._seq] = time.monotonic()

    def _drain_acks(self) -> None:
        """Take the followers' acks that arrived (without waiting): raises TensorParallelError for a
        follower whose digest differs from rank 0's at the same batch, or that is silent too long."""
        while self._acks.poll(0):
            ack = _acks.decode(self._acks.recv())
            self._acked[ack.rank] = max(self._acked.get(ack.rank, 0), ack.seq)
            if ack.step_ms_mean or ack.collective_us:
                before = self._rank_times.get(ack.rank, ({}, {}))
                self._rank_times[ack.rank] = (ack.step_ms_mean or before[0], ack.collective_us or before[1])
            if ack.seq not in self._after:  # a batch whose call raised here: this rank is on its way out
                continue
            digest, steps, policy = self._after[ack.seq]
            step_ms, collective_us = self._rank_times.get(ack.rank, ({}, {}))
            self._ranks[ack.rank] = RankState(rank=ack.rank, step=steps, agrees=ack.digest == digest, policy=policy,
                                              step_ms_mean=step_ms, collective_us=collective_us)
            if ack.digest != digest:
                raise TensorParallelError(f"rank {ack.rank} diverged from rank 0 after batch {ack.seq} (state "
                                          f"digest {ack.digest} vs {digest}); the group must restart")
        if not self._acked:
            return
        done = min(self._acked.values())
        for seq in [q for q in self._sent if q <= done]:
            del self._sent[seq]
            self._after.pop(seq, None)
        if self._sent:
            oldest = min(self._sent)
            silent = time.monotonic() - self._sent[oldest]
            if silent > SILENT_AFTER_S:
                if self._acks.poll(int(ACK_GRACE_S * 1000)):
                    return self._drain_acks()
                late = [r for r, q in self._acked.items() if q < oldest]
                raise TensorParallelError(f"rank(s) {late} have not answered rank 0's batch {oldest} for "
                                          f"{silent:.0f} s; the group must restart")

    def _sync(self, call: Step | Flush, run: Callable[[], Any]) -> Any:
        """Send the pending calls and this one, then run it here (the others do the same)."""
        self._now = call.now = time.monotonic()
        t0 = time.perf_counter()
        self._send(call)
        self._times.add("plan", time.perf_counter() - t0)
        self.deadline.begin(*step_kind_and_work(self._engine))
        try:
            result = run()
        finally:
            self.deadline.end()
        self._digest = state_digest(self._engine)
        self._digest_policy = served_policy(self._engine)
        if self._acked:
            self._after[self._seq] = (self._digest, self._engine.steps, self._digest_policy)
        return result

    def step_progress(self) -> tuple[float, float]:
        """(seconds the step in progress has run, its deadline; (0, 0) between steps): what rank 0's
        heartbeat thread reports, so that the supervisor restarts a group whose step outlived its
        deadline (a rank hangs: step_deadline.py)."""
        return self.deadline.progress()

    def stats(self):
        """The engine's stats, with what each rank serves as its last acknowledged batch confirmed."""
        self._drain_acks()
        stats = self._engine.stats()
        stats.ranks = [RankState(rank=0, step=self._engine.steps, policy=served_policy(self._engine),
                                 step_ms_mean=self._times.step_ms_mean(self._engine),
                                 collective_us=self._collective_us),
                       *self._ranks[1:]]
        return stats

    # the calls that change the engine's state
    def add_request(self, request: Request) -> None:
        if request.images:  # the other ranks replay ids and spec only (docs/vision.md)
            raise RequestRejected("image input is not served with engine.tensor_parallel > 1", "images")
        self._record(AddRequest(rid=request.rid, prompt_ids=list(request.prompt_ids), spec=request.spec),
                     lambda: self._engine.add_request(request))

    def abort(self, rid: str, reason: str = "abort", index: int | None = None) -> bool:
        return self._record(AbortRequest(rid=rid, reason=reason, index=index),
                            lambda: self._engine.abort(rid, reason, index))

    def add_score(self, qid: str, ids, start: int = 1, top_logprobs: int = 0, adapter: str = "",
                  adapter_version: int = 0) -> None:
        call = AddScore(qid=qid, ids=[int(t) for t in ids], start=start, top_logprobs=top_logprobs, adapter=adapter,
                        adapter_version=adapter_version)
        self._record(call, lambda: self._engine.add_score(qid, call.ids, start, top_logprobs, adapter, adapter_version))

    def load_adapter(self, name: str, *, config: dict | None = None, weights: bytes | dict | None = None,
                     path: str = "", format: str = "auto", version: int = 0):
        """Load here, then on every other rank before the next step: each rank slices the adapter for its
        shard (parallm/adapters/sharded.py). The others get the same safetensors bytes, or read the
        same path (on several machines, a path every machine has)."""
        if isinstance(weights, dict):
            weights = save_bytes(weights)
        call = LoadAdapter(name=name, config=config, weights=weights, path=path, format=format, version=version)
        return self._record(call, lambda: _load_adapter(self._engine, call))

    def unload_adapter(self, name: str) -> int:
        return self._record(UnloadAdapter(name=name), lambda: self._engine.unload_adapter(name))

    def follow_latest(self) -> int:
        return self._record(FollowLatest(), self._engine.follow_latest)

    def set_default_adapter(self, name: str) -> None:
        self._record(SetDefaultAdapter(name=name), lambda: self._engine.set_default_adapter(name))

    def drop_cached_blocks(self) -> int:
        return self._record(DropCachedBlocks(), self._engine.drop_cached_blocks)

    def update_weights(self, *, path: str = "", tensors: dict | None = None, version: int = 0,
                       complete: bool = True):
        """New base weights here, then on every other rank before the next step; each rank keeps its
        shard of every tensor (parallm/engine/weights.py slices them as mlx-lm's shard() did). The
        others read the same directory, or get the tensors as safetensors bytes."""
        def run():
            return self._engine.update_weights(path=path, tensors=tensors, version=version, complete=complete)

        call = UpdateWeights(path=path, weights=save_bytes(tensors) if tensors else b"", version=version,
                             complete=complete)
        return self._record(call, run)

    def step(self, emit: Callable | None = None) -> list:
        pacer = self._engine.pacer
        call = Step(prefill_rate=pacer.seconds_per_unit, prefill_fixed_s=pacer.fixed_s)
        return self._sync(call, lambda: self._engine.step(emit=emit))

    def flush(self) -> list:
        return self._sync(Flush(), self._engine.flush)

    def score(self, *args: Any, **kwargs: Any):
        raise TensorParallelError("Engine.score steps on its own; a tensor-parallel engine takes add_score "
                                  "and step()")

    def idle(self) -> None:
        """Nothing to do for now: the other ranks block in their receive until the next batch; take
        the acks that arrived meanwhile."""
        self._drain_acks()

    def close(self) -> None:
        """Tell the other ranks to return from `follow` (the stage is shutting down)."""
        stop = RankBatch(calls=[StopFollowing(now=time.monotonic())], digest=self._digest, seq=self._seq + 1)
        self._calls.send(protocol.encode(stop))
        self.close_sockets()

    def close_sockets(self) -> None:
        self._calls.close(linger=1000)  # the stop batch still goes out
        self._acks.close()


def _load_adapter(engine, call: LoadAdapter) -> Any:
    return engine.load_adapter(call.name, config=call.config, weights=call.weights, path=call.path,
                               format=call.format, version=call.version)


def _step(engine, call: Step) -> Any:
    engine.pacer.seconds_per_unit, engine.pacer.fixed_s = call.prefill_rate, call.prefill_fixed_s  # rank 0's (Step)
    return engine.step()


_REPLAY: dict[type, Callable[[Any, Any], Any]] = {
    AddRequest: lambda engine, c: engine.add_request(Request(c.rid, c.prompt_ids, c.spec)),
    AbortRequest: lambda engine, c: engine.abort(c.rid, c.reason, c.index),
    AddScore: lambda engine, c: engine.add_score(c.qid, c.ids, c.start, c.top_logprobs, c.adapter, c.adapter_version),
    LoadAdapter: _load_adapter,
    UnloadAdapter: lambda engine, c: engine.unload_adapter(c.name),
    SetDefaultAdapter: lambda engine, c: engine.set_default_adapter(c.name),
    FollowLatest: lambda engine, c: engine.follow_latest(),
    DropCachedBlocks: lambda engine, c: engine.drop_cached_blocks(),
    UpdateWeights: lambda engine, c: engine.update_weights(path=c.path, tensors=load_bytes(c.weights) if c.weights
                                                           else None, version=c.version, complete=c.complete),
    Step: lambda engine, c: _step(engine, c),
    Flush: lambda engine, c: engine.flush(),
}
"""How a follower replays each call rank 0 sends (StopFollowing ends `follow` instead)."""


def follower_main(config, replica: int = 0) -> int:
    """Rank > 0 of the engine stage: join the group, load and shard the model, build the engine as
    rank 0 does, and follow it. A failure exits non-zero, which makes the supervisor restart the group."""
    from parallm.models import load_model

    from .engine import Engine
    from .model import EngineModel

    from parallm.models.preload import load_adapters_at_start

    group = join(config.engine.tensor_parallel, default_backend())
    loaded = load_model(config.model, kv_budget_mb=config.engine.kv_budget_mb)
    shard_model(loaded.model, group)
    engine = Engine(EngineModel.of(loaded), agreed_config(config, group))
    load_adapters_at_start(engine, config.adapters.preload)  # as rank 0 does, in the same order
    freeze_clock(engine)
    engine.warm_up()
    collective_us = probe_collectives(loaded.model, group)  # with rank 0's, right after its warm-up
    return follow(engine, group, control_addresses(config.transport.run_dir, replica), collective_us)


def freeze_clock(engine) -> None:
    """A clock that stands still and a prefill pacer that does not learn, for the warm-up every rank
    runs on its own before serving: its passes (and their collectives) must have the same shapes on
    every rank, and a pacer that timed each rank's own warm-up passes would chunk the later warm-up
    prompts by that rank's speed (a slower rank one more pass: its collectives no longer pair up and
    the group hangs before it serves). Serving undoes both (Leader, follow): the clock and the
    pacing rate are rank 0's from then on."""
    engine.scheduler.policy.clock = lambda: 0.0
    engine.pacer.learning = False


def follow(engine, group: mx.distributed.Group, addresses: tuple[str, str],
           collective_us: dict[str, float] | None = None) -> int:
    """A rank other than 0: replay rank 0's calls (from `addresses`, as control_addresses) on this
    rank's engine until it says stop, acknowledging each batch with this rank's digest and its step
    phases so far (rank_timing.py; `collective_us`, its probe, in the first ack).
    Returns 0 then; raises TensorParallelError when this rank's state no longer matches rank 0's or a
    batch went missing."""
    calls = channel_socket(zmq.SUB, addresses[0], bind=False)
    calls.setsockopt(zmq.SUBSCRIBE, b"")
    acks = channel_socket(zmq.PUSH, addresses[1], bind=False)
    now = time.monotonic()
    engine.scheduler.policy.clock = lambda: now
    engine.pacer.learning = True  # its rate is rank 0's at every step (Step.prefill_rate)
    digest = state_digest(engine)
    rank, expected = group.rank(), 1
    times, probe = RankPhases("wait", "replay", "ack"), collective_us or {}
    log.info("rank %d of %d follows rank 0", rank, group.size())
    try:
        while True:
            t0 = time.perf_counter()
            batch = _batches.decode(calls.recv())  # blocks without polling while rank 0 is idle
            times.add("wait", time.perf_counter() - t0)
            if batch.seq != expected:
                raise TensorParallelError(f"rank {rank} got rank 0's batch {batch.seq}, expected {expected}: "
                                          "calls were lost; the group must restart")
            expected += 1
            if batch.digest != digest:
                raise TensorParallelError(f"rank {rank} diverged from rank 0 (state digest {digest} vs "
                                          f"{batch.digest}); the group must restart")
            for call in batch.calls:
                if isinstance(call, StopFollowing):
                    return 0
                now = call.now
                t0 = time.perf_counter()
                _REPLAY[type(call)](engine, call)
                if isinstance(call, (Step, Flush)):
                    digest = state_digest(engine)
                else:
                    times.add("replay", time.perf_counter() - t0)
            t0 = time.perf_counter()
            acks.send(protocol.encode(RankAck(rank=rank, seq=batch.seq, digest=digest, collective_us=probe,
                                              step_ms_mean=times.step_ms_mean(engine))))
            probe = {}
            times.add("ack", time.perf_counter() - t0)
    finally:
        calls.close()
        acks.close()
