"""The trainer's memory: a plan printed at start, micro-batches sized from a budget, per-layer
gradient checkpointing.

    weights       the base model's parameters as loaded (4-bit stays 4-bit: QLoRA)
    optimizer     the adapter's parameters, their gradients and Adam's two moments (4 x trainable)
    activations   what one micro-batch's backward keeps: per token and layer the saved tensors of
                  attention and MLP (with checkpointing: only each layer's input, plus one layer
                  recomputed at a time), the attention scores (L per head), and the float32 logits
                  with their softmax gradient (3 x vocab x 4 bytes per token)
    engine KV     the server's KV budget (its stats: kv_capacity_tokens x bytes_per_token), shown so
                  that server + trainer can be checked against the machine

The activation figure is an estimate from the model's shape (hidden, intermediate, heads, vocab);
every step's metrics line carries the measured peak (`peak_memory_mb`) beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

MiB = 2 ** 20
GRAD_CHECKPOINT_ABOVE_PARAMS = 1_000_000_000   # unset memory.grad_checkpoint: on from 1B base parameters


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    itemsize: int          # bytes of one activation value (the compute dtype)
    params: int            # base parameters (quantized ones counted unpacked)


def model_shape(model: nn.Module) -> Shape:
    """The dimensions the estimate needs, from mlx-lm's ModelArgs (or the embedding when it lacks them)."""
    args = getattr(model, "args", None)
    flat = tree_flatten(model.parameters())
    embed = next((v for k, v in flat if "embed_tokens" in k and k.endswith(".weight")), None)
    hidden = int(getattr(args, "hidden_size", 0) or (embed.shape[1] if embed is not None else 0))
    compute = next((v.dtype for k, v in flat if k.endswith("norm.weight")), mx.float32)
    modules = dict(model.named_modules())
    packed = {k.rpartition(".")[0] for k, v in flat if k.endswith(".weight") and v.dtype == mx.uint32}
    params = 0
    for name, value in flat:
        owner, _, leaf = name.rpartition(".")
        if owner in packed and leaf in ("scales", "biases"):
            continue
        params += value.size * 32 // int(getattr(modules.get(owner), "bits", 32)) if owner in packed else value.size
    return Shape(layers=len(getattr(model, "layers", [])) or 1, hidden=hidden,
                 intermediate=int(getattr(args, "intermediate_size", 0) or 4 * hidden),
                 heads=int(getattr(args, "num_attention_heads", 0) or max(1, hidden // 64)),
                 vocab=int(getattr(args, "vocab_size", 0) or (embed.shape[0] if embed is not None else 0)),
                 itemsize=compute.size, params=params)


def activation_bytes(shape: Shape, seq_len: int, *, checkpointed: bool) -> int:
    """Bytes one sequence of `seq_len` tokens keeps for its backward pass (see the module docstring)."""
    s = shape.itemsize
    per_layer = s * (9 * shape.hidden + 4 * shape.intermediate) + 2 * s * shape.heads * seq_len
    kept = shape.layers * s * shape.hidden + per_layer if checkpointed else shape.layers * per_layer
    logits = 3 * 4 * shape.vocab
    return seq_len * (kept + logits)


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    trainable: int
    optimizer: int            # adapter weights + gradients + Adam's moments
    seq_len: int
    per_sequence: int         # activations of one sequence of seq_len tokens
    micro_batch: int
    grad_checkpoint: bool
    engine_kv: int            # 0: not known (no stats from the engine)
    budget: int               # 0: none

    @property
    def activations(self) -> int:
        return self.per_sequence * self.micro_batch

    @property
    def trainer_total(self) -> int:
        return self.weights + self.optimizer + self.activations

    def lines(self) -> list[str]:
        mib = lambda n: f"{n / MiB:,.0f} MiB"  # noqa: E731
        out = [f"weights {mib(self.weights)}",
               f"adapter + gradients + Adam {mib(self.optimizer)} ({self.trainable:,} trainable parameters)",
               f"activations {mib(self.activations)} ({self.micro_batch} sequences x {self.seq_len} tokens per "
               f"micro-batch, {mib(self.per_sequence)} each, gradient checkpointing "
               f"{'on' if self.grad_checkpoint else 'off'})",
               f"trainer total {mib(self.trainer_total)}" + (f" of a {mib(self.budget)} budget" if self.budget else "")]
        if self.engine_kv:
            out.append(f"engine KV budget {mib(self.engine_kv)}; server weights + KV + trainer "
                       f"{mib(self.engine_kv + self.weights + self.trainer_total)}")
        return out


class TrainerMemoryError(ValueError):
    """The trainer cannot fit its budget; the message holds the plan."""


def make_plan(model: nn.Module, *, trainable: int, seq_len: int, micro_batch: int, grad_checkpoint: bool | None,
              budget_mb: float = 0.0, engine_kv: int = 0) -> MemoryPlan:
    """The plan for `model` (its adapters attached); with a budget, micro_batch is the most sequences of
    `seq_len` tokens that fit it (at most the configured one), and a budget that does not hold even one
    is a TrainerMemoryError naming what takes the memory."""
    shape = model_shape(model)
    checkpoint = shape.params >= GRAD_CHECKPOINT_ABOVE_PARAMS if grad_checkpoint is None else grad_checkpoint
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    optimizer = 4 * 4 * trainable
    per_sequence = activation_bytes(shape, seq_len, checkpointed=checkpoint)
    budget = int(budget_mb * MiB)
    if budget:
        room = budget - weights - optimizer
        fits = room // per_sequence if per_sequence else micro_batch
        if fits < 1:
            plan = MemoryPlan(weights, trainable, optimizer, seq_len, per_sequence, 1, checkpoint, engine_kv, budget)
            raise TrainerMemoryError(f"trainer.memory.budget_mb {budget_mb:g} holds no micro-batch of one {seq_len}-token "
                               f"sequence: {'; '.join(plan.lines())}" + ("" if checkpoint else
                                                                        "; memory.grad_checkpoint = true would help"))
        micro_batch = max(1, min(micro_batch, int(fits)))
    return MemoryPlan(weights, trainable, optimizer, seq_len, per_sequence, micro_batch, checkpoint, engine_kv, budget)


def checkpoint_layers(model: nn.Module) -> int:
    """Per-layer gradient checkpointing: each transformer layer's forward is recomputed in the backward
    pass instead of keeping its activations (mx.checkpoint, as mlx_lm.tuner's grad_checkpoint). Done per
    instance (each layer gets a subclass of its own class), so other models in the process are untouched
    and parameter names stay as they are. Returns the layers changed."""
    changed = 0
    for layer in getattr(model, "layers", []):
        cls = type(layer)
        if getattr(cls, "_parallm_checkpointed", False):
            continue
        layer.__class__ = _checkpointed_class(cls)
        changed += 1
    return changed


_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:
        forward = cls.__call__

        def __call__(self, *args, **kwargs):
            def inner(params, *args, **kwargs):
                self.update(params)
                return forward(self, *args, **kwargs)

            return mx.checkpoint(inner)(self.trainable_parameters(), *args, **kwargs)

        _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__,
                                                                      "_parallm_checkpointed": True})
    return _CLASSES[cls]
