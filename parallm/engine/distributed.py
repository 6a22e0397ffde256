"""Tensor parallelism: one engine as a group of ranks over MLX's own distributed layer.

Every rank loads the model, shards it with mlx-lm's `model.shard(group)` (each rank keeps a slice
of the attention heads and MLP columns; the layers' `sharded-to-all` projections all-sum their
outputs) and builds the same `Engine`. Rank 0 serves: the engine stage wraps its engine in a
`Leader`, which records every call that changes the engine's state (a request added, an abort,
an adapter loaded, a step, ...) and, before each step, broadcasts the calls since the last one
with `mx.distributed.all_sum` (the other ranks contribute zeros). The other ranks run `follow`:
they replay the same calls on their own engine, so every rank schedules the same plan and runs the
same passes in lockstep. The scheduler's clock (priority aging) is rank 0's, sent with each call.

Sampling runs on every rank, on the same logits: the all-sum leaves identical logits on every
rank, and a row's sampler is seeded by its request, so each rank draws the same tokens without a
per-step broadcast of them (what mlx-lm's server does too); only rank 0's outputs leave the
process. Each broadcast carries a digest of rank 0's state after its previous step, which a
follower compares with its own: a rank that diverged exits, and the supervisor restarts the group.

A rank waiting in a collective polls its sockets (about 40 % of a core on the ring backend), so
while rank 0 has nothing to do it says so (`Leader.idle`) and the others wait on a ZeroMQ doorbell
instead, which rank 0 rings before its next broadcast: the doorbell carries no data, the calls still
travel in the collective.

Nothing here waits forever on its own: a dead rank ends the group's collectives with an error or
leaves them blocked, and the supervisor, which watches every rank's process and rank 0's
heartbeats, kills and restarts the whole group (docs/operations.md, "More than one device").
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import msgspec
import zmq

from parallm.adapters import load_bytes, save_bytes
from parallm.adapters.sharded import recording_segments
from parallm.protocol import RankState, RequestSpec

from .request import Request

log = logging.getLogger("parallm.engine.distributed")

BELL_WAIT_S = 60
HEADER_BYTES = 4096  # the first all-sum of a broadcast: 8 bytes of length, the payload if it fits, 8 bytes per rank


class TensorParallelError(RuntimeError):
    """The group cannot be formed, the model cannot be sharded, or the ranks diverged."""


# ------------------------------------------------------------------ the group

def rank_from_env() -> int:
    """This process's rank as MLX's launchers set it (MLX_RANK; 0 when unset)."""
    try:
        return int(os.environ.get("MLX_RANK", "0"))
    except ValueError:
        raise TensorParallelError(f"MLX_RANK={os.environ['MLX_RANK']!r} is not an integer") from None


def default_backend() -> str:
    """NCCL where MLX computes on CUDA GPUs and has it, else the ring backend (CPUs, Thunderbolt)."""
    if mx.cuda.is_available() and mx.distributed.is_available("nccl"):
        return "nccl"
    return "ring"


def join(size: int, backend: str = "any") -> mx.distributed.Group:
    """Join the group of `size` ranks that the launcher (parallm's supervisor or `mlx.launch`) set up
    in this process's environment; raises TensorParallelError when it is not that group."""
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise TensorParallelError(f"cannot join the {backend} group of {size} ranks: {exc}") from None
    if group.size() != size:
        raise TensorParallelError(f"engine.tensor_parallel is {size} but MLX's {backend} group has "
                                  f"{group.size()} rank(s)")
    return group


def broadcast(group: mx.distributed.Group, payload: bytes | None = None, echo: int = 0) -> tuple[bytes, list[int]]:
    """Rank 0's `payload` on every rank (the others pass None), and every rank's `echo` (a 63-bit
    number) on every rank: an all-sum to which rank 0 contributes the payload and each rank its echo
    in its own slot, one collective for a payload that fits the header, two past it."""
    size = group.size()
    inline_max = HEADER_BYTES - 8 - 8 * size
    head = bytearray(HEADER_BYTES)
    if group.rank() == 0:
        data = payload or b""
        head[:8] = struct.pack("<Q", len(data))
        inline = data[:inline_max]
        head[8:8 + len(inline)] = inline
    slot = HEADER_BYTES - 8 * (size - group.rank())
    head[slot:slot + 8] = struct.pack("<Q", echo)
    got = mx.distributed.all_sum(mx.array(memoryview(head), dtype=mx.uint8), group=group)
    got_bytes = bytes(memoryview(got))
    echoes = list(struct.unpack(f"<{size}Q", got_bytes[HEADER_BYTES - 8 * size:]))
    n = struct.unpack("<Q", got_bytes[:8])[0]
    if n <= inline_max:
        return got_bytes[8:8 + n], echoes
    tail = mx.zeros((n - inline_max,), dtype=mx.uint8)
    if group.rank() == 0:
        tail = mx.array(memoryview(payload[inline_max:]), dtype=mx.uint8)
    tail = mx.distributed.all_sum(tail, group=group)
    return got_bytes[8:8 + inline_max] + bytes(memoryview(tail)), echoes


def agree_min(group: mx.distributed.Group, value: float) -> float:
    """The smallest of every rank's `value` (e.g. the KV budget each rank's free memory allows)."""
    gathered = mx.distributed.all_gather(mx.array([value], dtype=mx.float32), group=group)
    return float(mx.min(gathered).item())


# ------------------------------------------------------------------ sharding

def shard_refusal(model: nn.Module, size: int) -> str | None:
    """Why mlx-lm cannot shard `model` over `size` ranks, or None when it can."""
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__.rsplit(".", 1)[-1])
    if not callable(getattr(model, "shard", None)):
        return (f"mlx-lm's {model_type!r} model has no shard() method, so it cannot run tensor-parallel; "
                "serve it with engine.tensor_parallel=1 (or engine replicas)")
    args = getattr(model, "args", None)
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(args, field, None)
        if isinstance(value, int) and value % size:
            return (f"the {model_type!r} model's {field} ({value}) is not divisible by engine.tensor_parallel "
                    f"({size}); choose a tensor-parallel size that divides it")
    return None


def shard_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """Shard `model` in place over `group` with mlx-lm's own `shard` (refused with TensorParallelError
    where the model has none or its heads do not split evenly)."""
    reason = shard_refusal(model, group.size())
    if reason is not None:
        raise TensorParallelError(reason)
    with recording_segments():  # a fused layer's adapters are sliced by the same segments
        model.shard(group)
    mx.eval(model.parameters())


# ------------------------------------------------------------------ the calls rank 0 broadcasts

class Call(msgspec.Struct, array_like=True):
    """One engine call: its name, rank 0's clock when it was made, and its arguments."""

    method: str
    now: float
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class Batch(msgspec.Struct, array_like=True):
    """What rank 0 broadcasts before a step: the calls since the last broadcast (the step last) and
    the digest of its state after the previous step."""

    calls: list[Call]
    digest: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)


def served_policy(engine) -> dict[str, int]:
    """{adapter: latest version} and, under "", the base weights' version."""
    return {**engine.policy(), "": engine.weights_version}


def state_digest(engine) -> int:
    """A cheap fingerprint of what the scheduler decided so far and of the adapter versions and base
    weights each rank serves: equal on ranks that agree (strings by crc32: hash() of a str differs
    between processes)."""
    s = engine.scheduler
    key = (engine._steps, len(s.waiting), tuple((q.seq_id, q.num_computed, q.num_tokens) for q in s.running),
           tuple((q.seq_id, q.num_computed) for q in s.prefilling), engine.weights_version,
           zlib.crc32(repr((sorted(engine.policy().items()), engine.adapters.default_name)).encode()))
    return hash(key) & 0x7FFFFFFFFFFFFFFF


class Leader:
    """Rank 0's engine: the real `Engine`, with every state-changing call recorded and broadcast to
    the other ranks before each step (module docstring). Reads (stats, has_work, ...) pass through."""

    def __init__(self, engine, group: mx.distributed.Group, doorbell: str | None = None) -> None:
        """`doorbell`: the address (doorbell_address) the other ranks wait on while this one is idle."""
        self._engine = engine
        self._group = group
        self._bell = zmq.Context.instance().socket(zmq.XPUB) if doorbell else None
        if self._bell is not None:
            self._bell.setsockopt(zmq.LINGER, 0)
            self._bell.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._bell.bind(doorbell)
            for _ in range(group.size() - 1):  # every other rank listens before a ring can be lost
                if not self._bell.poll(BELL_WAIT_S * 1000):
                    raise TensorParallelError(f"the other ranks did not connect to {doorbell} within "
                                              f"{BELL_WAIT_S} s")
                self._bell.recv()
        self._idle = False
        self._pending: list[Call] = []
        self._now = time.monotonic()
        self._digest = state_digest(engine)
        self._digest_policy = served_policy(engine)  # what rank 0 served when it computed _digest
        self._ranks = [RankState(rank=r, policy=self._digest_policy) for r in range(group.size())]
        engine.scheduler.policy.clock = lambda: self._now
        self.adapters = _RecordingAdapters(engine.adapters, self._record)
        self.blocks = _RecordingBlocks(engine.blocks, self._record) if engine.blocks is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def group(self) -> mx.distributed.Group:
        return self._group

    def _record(self, method: str, *args: Any, run: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the call here (`run`, else the engine's method of that name); if it raised nothing,
        queue it for the others."""
        self._now = time.monotonic()
        result = run() if run is not None else getattr(self._engine, method)(*args, **kwargs)
        self._pending.append(Call(method, self._now, list(args), kwargs))
        return result

    def _send(self, *calls: Call) -> None:
        """Broadcast the pending calls and `calls` (ringing the doorbell first if the others wait on it)."""
        if self._idle:
            self._bell.send(b"")
            self._idle = False
        self._pending.extend(calls)
        batch, self._pending = Batch(self._pending, self._digest), []
        _, echoes = broadcast(self._group, _encoder.encode(batch), self._digest)
        for r in range(1, len(echoes)):  # each rank's digest after the step rank 0's digest is of
            self._ranks[r] = RankState(rank=r, step=self._engine._steps, agrees=echoes[r] == self._digest,
                                       policy=self._digest_policy)

    def _sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Broadcast the pending calls and this one, then run it here (the others do the same)."""
        self._now = time.monotonic()
        self._send(Call(method, self._now))
        result = getattr(self._engine, method)(*args, **kwargs)
        self._digest = state_digest(self._engine)
        self._digest_policy = served_policy(self._engine)
        return result

    def stats(self):
        """The engine's stats, with what each rank serves as its last step broadcast confirmed."""
        stats = self._engine.stats()
        stats.ranks = [RankState(rank=0, step=self._engine._steps, policy=served_policy(self._engine)),
                       *self._ranks[1:]]
        return stats

    # the calls that change the engine's state
    def add_request(self, request: Request) -> None:
        self._record("add_request", request.rid, list(request.prompt_ids), _encoder.encode(request.spec),
                     run=lambda: self._engine.add_request(request))

    def abort(self, rid: str, reason: str = "abort", index: int | None = None) -> bool:
        return self._record("abort", rid, reason, index)

    def add_score(self, qid: str, ids, start: int = 1, top_logprobs: int = 0, adapter: str = "",
                  adapter_version: int = 0) -> None:
        self._record("add_score", qid, [int(t) for t in ids], start, top_logprobs, adapter, adapter_version)

    def load_adapter(self, name: str, *, config: dict | None = None, weights: bytes | dict | None = None,
                     path: str = "", format: str = "auto", version: int = 0):
        """Load here, then on every other rank before the next step: each rank slices the adapter for its
        shard (parallm/adapters/sharded.py). The others get the same safetensors bytes, or read the
        same path (on several machines, a path every machine has)."""
        if isinstance(weights, dict):
            weights = save_bytes(weights)
        return self._record("load_adapter", name, config=config, weights=weights, path=path, format=format,
                            version=version)

    def unload_adapter(self, name: str) -> int:
        return self._record("unload_adapter", name)

    def follow_latest(self) -> int:
        return self._record("follow_latest")

    def update_weights(self, *, path: str = "", tensors: dict | None = None, version: int = 0,
                       complete: bool = True):
        """New base weights here, then on every other rank before the next step; each rank keeps its
        shard of every tensor (parallm/engine/weights.py slices them as mlx-lm's shard() did). The
        others read the same directory, or get the tensors as safetensors bytes."""
        def run():
            return self._engine.update_weights(path=path, tensors=tensors, version=version, complete=complete)

        data = save_bytes(tensors) if tensors else b""
        return self._record("update_weights", path=path, weights=data, version=version, complete=complete, run=run)

    def step(self, emit: Callable | None = None) -> list:
        return self._sync("step", emit=emit)

    def flush(self) -> list:
        return self._sync("flush")

    def score(self, *args: Any, **kwargs: Any):
        raise TensorParallelError("Engine.score steps on its own; a tensor-parallel engine takes add_score "
                                  "and step()")

    def idle(self) -> None:
        """Nothing to do for now: the other ranks wait on the doorbell until the next broadcast."""
        if self._bell is not None and not self._idle:
            self._send(Call("idle", time.monotonic()))
            self._idle = True

    def close(self) -> None:
        """Tell the other ranks to return from `follow` (the stage is shutting down)."""
        self._send(Call("stop", time.monotonic()))
        if self._bell is not None:
            self._bell.close()


class _RecordingAdapters:
    """`engine.adapters` on rank 0: `set_default` is recorded like the engine's calls."""

    def __init__(self, adapters, record: Callable[..., Any]) -> None:
        self._adapters = adapters
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapters, name)

    def set_default(self, name: str) -> None:
        self._record("set_default", name, run=lambda: self._adapters.set_default(name))


class _RecordingBlocks:
    """`engine.blocks` on rank 0: dropping the cached prefix blocks is recorded like the engine's calls."""

    def __init__(self, blocks, record: Callable[..., Any]) -> None:
        self._blocks = blocks
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._blocks, name)

    def drop_cached(self) -> int:
        return self._record("drop_cached", run=self._blocks.drop_cached)


def _replay(engine, call: Call) -> None:
    if call.method == "add_request":
        rid, prompt_ids, spec = call.args
        engine.add_request(Request(rid, prompt_ids, msgspec.msgpack.decode(spec, type=RequestSpec)))
    elif call.method == "set_default":
        engine.adapters.set_default(*call.args)
    elif call.method == "drop_cached":
        engine.blocks.drop_cached()
    elif call.method == "update_weights":
        kw = dict(call.kwargs)
        data = kw.pop("weights")
        engine.update_weights(tensors=load_bytes(data) if data else None, **kw)
    elif call.method in ("abort", "add_score", "load_adapter", "unload_adapter", "follow_latest", "step", "flush"):
        getattr(engine, call.method)(*call.args, **call.kwargs)
    else:
        raise TensorParallelError(f"rank 0 sent an unknown call {call.method!r}")


def agreed_config(config, group: mx.distributed.Group):
    """`config` with the KV budget every rank can hold (the smallest of theirs), so that every rank
    plans with the same number of token slots."""
    import msgspec.structs

    from .memory import auto_kv_budget_bytes

    mb = config.engine.kv_budget_mb or auto_kv_budget_bytes() / (1 << 20)
    engine = msgspec.structs.replace(config.engine, kv_budget_mb=agree_min(group, mb))
    return msgspec.structs.replace(config, engine=engine)


def follower_main(config, replica: int = 0) -> int:
    """Rank > 0 of the engine stage: join the group, load and shard the model, build the engine as
    rank 0 does, and follow it. A failure exits non-zero, which makes the supervisor restart the group."""
    from parallm.models import load_model

    from .engine import Engine
    from .model import EngineModel

    from parallm.models.preload import load_adapters_at_start

    group = join(config.engine.tensor_parallel, default_backend())
    loaded = load_model(config.model)
    shard_model(loaded.model, group)
    engine = Engine(EngineModel.of(loaded), agreed_config(config, group))
    load_adapters_at_start(engine, config.adapters.preload)  # as rank 0 does, in the same order
    freeze_clock(engine)
    engine.warm_up()
    return follow(engine, group, doorbell_address(config.transport.run_dir, replica))


def freeze_clock(engine) -> None:
    """A clock that stands still, for the warm-up every rank runs on its own before serving: its
    passes (and their collectives) must have the same shapes on every rank."""
    engine.scheduler.policy.clock = lambda: 0.0


def doorbell_address(run_dir: str, replica: int = 0) -> str:
    return f"ipc://{os.path.abspath(run_dir)}/engine-{replica}-doorbell.sock"


def follow(engine, group: mx.distributed.Group, doorbell: str | None = None) -> int:
    """A rank other than 0: replay rank 0's calls on this rank's engine until it says stop. Returns
    0 then; raises TensorParallelError when this rank's state no longer matches rank 0's."""
    bell = None
    if doorbell:
        bell = zmq.Context.instance().socket(zmq.SUB)
        bell.setsockopt(zmq.LINGER, 0)
        bell.setsockopt(zmq.SUBSCRIBE, b"")
        bell.connect(doorbell)
    now = time.monotonic()
    engine.scheduler.policy.clock = lambda: now
    digest = state_digest(engine)
    log.info("rank %d of %d follows rank 0", group.rank(), group.size())
    while True:
        data, _ = broadcast(group, echo=digest)
        batch = _decoder.decode(data)
        if batch.digest != digest:
            raise TensorParallelError(f"rank {group.rank()} diverged from rank 0 (state digest {digest} vs "
                                      f"{batch.digest}); the group must restart")
        for call in batch.calls:
            if call.method == "stop":
                return 0
            if call.method == "idle":
                bell.recv()  # rank 0 rings before its next broadcast
                continue
            now = call.now
            _replay(engine, call)
            if call.method in ("step", "flush"):
                digest = state_digest(engine)
