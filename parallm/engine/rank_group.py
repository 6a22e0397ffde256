"""The rank group of a tensor-parallel engine: joining the group MLX's launcher set up, where rank 0's
call channel is, sharding the model with mlx-lm's own `shard`, and the settings every rank must agree
on. What the ranks do once formed (rank 0's calls replayed by the others) is parallm/engine/distributed.py."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import zmq

from parallm.adapters.sharded import recording_segments


CONTROL_ENV = "PARALLM_TP_CONTROL"  # "CALLS,ACKS": the channel's tcp:// addresses when a rank is on another machine


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


def agree_min(group: mx.distributed.Group, value: float) -> float:
    """The smallest of every rank's `value` (e.g. the KV budget each rank's free memory allows)."""
    gathered = mx.distributed.all_gather(mx.array([value], dtype=mx.float32), group=group)
    return float(mx.min(gathered).item())


def control_addresses(run_dir: str, replica: int = 0) -> tuple[str, str]:
    """Where replica `replica`'s group talks: rank 0's calls, the followers' acks. The ipc sockets in
    the run dir, unless the supervisor set CONTROL_ENV (a rank on another machine: tcp://)."""
    given = os.environ.get(CONTROL_ENV, "")
    if given:
        calls, _, acks = given.partition(",")
        if not (calls.startswith("tcp://") and acks.startswith("tcp://")):
            raise TensorParallelError(f"{CONTROL_ENV}={given!r} is not two tcp:// addresses, calls then acks")
        return calls, acks
    base = f"ipc://{os.path.abspath(run_dir)}/engine-{replica}"
    return f"{base}-calls.sock", f"{base}-acks.sock"


def channel_socket(kind: int, address: str, *, bind: bool) -> zmq.Socket:
    """A socket of the group's call channel: no high-water mark (a batch is never dropped), no size limit
    on what a follower receives (a batch can carry a weight update); over tcp:// with this process's
    CURVE keys (parallm/transport.py; the supervisor refuses ranks on other machines without them)."""
    ctx = zmq.Context.instance()
    if address.startswith("tcp://"):
        from parallm.transport import open_socket, set_max_message_bytes

        if not bind:
            set_max_message_bytes(-1)  # a follower opens no other socket
        return open_socket(ctx, kind, address, bind=bind, hwm=0)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


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


def agreed_config(config, group: mx.distributed.Group):
    """`config` with the KV budget every rank can hold (the smallest of theirs), so that every rank
    plans with the same number of token slots."""
    import msgspec.structs

    from .memory import auto_kv_budget_bytes

    mb = config.engine.kv_budget_mb or auto_kv_budget_bytes() / (1 << 20)
    engine = msgspec.structs.replace(config.engine, kv_budget_mb=agree_min(group, mb))
    return msgspec.structs.replace(config, engine=engine)
