"""GRPO on MLX: group-normalised advantages and the clipped, importance-corrected token loss.

For sample i of a group with rewards r, the advantage is A_i = (r_i - mean(r)) / (std(r) + eps)
(or only centred, Dr. GRPO's choice, with `scale_rewards` off). Every completion token t gets

    ratio_t = exp(logp_theta(t) - logp_sampler(t))
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A) + beta * KL_t

where logp_sampler is what the server reported when it sampled the token: the ratio corrects for
the gap between the version that sampled and the weights being trained (a prefetched batch, a
rollout from another client, numerics of another dtype). KL_t is the k3 estimator against the
base model's teacher-forced logprobs, exp(ref - new) - (ref - new) - 1. The loss is averaged over
every completion token of the step (token-level, as DAPO), so long and short completions weigh
by their tokens. Nothing here knows about sockets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map


@dataclass
class Sample:
    """One completion as trained on: ids, the sampler's logprobs, reward and advantage."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    reward: float = 0.0
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    version: int = 0                       # oldest policy version among its tokens
    text: str = ""
    finish_reason: str | None = None


@dataclass
class StepStats:
    loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    ratio_mean: float = 1.0
    grad_norm: float = 0.0
    tokens: int = 0
    logprob_gap_mean: float = 0.0   # mean |logp_trainer - logp_sampler| over the step's tokens, before the update
    logprob_gap_max: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def group_advantages(rewards: Sequence[float], *, scale: bool = True, eps: float = 1e-4) -> list[float]:
    """Rewards of one group centred on their mean (and divided by their std when `scale`)."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not scale:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / (std + eps) for c in centred]


def _pad(rows: Sequence[Sequence[float]], width: int, value: float = 0.0) -> list[list[float]]:
    return [list(r) + [value] * (width - len(r)) for r in rows]


@dataclass
class Batch:
    """Right-padded model inputs and, per target position, what the loss needs (0 off-completion)."""

    inputs: mx.array          # [B, L] int32
    targets: mx.array         # [B, L] int32
    mask: mx.array            # [B, L] float32, 1 on completion tokens
    old_logprobs: mx.array    # [B, L] sampler logprobs
    ref_logprobs: mx.array    # [B, L] base-model logprobs (zeros without KL)
    advantages: mx.array      # [B, 1]


def make_batch(samples: Sequence[Sample]) -> Batch:
    """Inputs are prompt + completion minus the last token; targets the same shifted by one, so
    position p predicts token p + 1 and the completion's targets start at len(prompt) - 1."""
    rows, targets, masks, olds, refs = [], [], [], [], []
    for s in samples:
        ids = list(s.prompt_ids) + list(s.completion_ids)
        start = len(s.prompt_ids) - 1
        n = len(s.completion_ids)
        rows.append(ids[:-1])
        targets.append(ids[1:])
        masks.append([0.0] * start + [1.0] * n)
        olds.append([0.0] * start + list(s.sampler_logprobs[:n]))
        refs.append([0.0] * start + list((s.ref_logprobs or [0.0] * n)[:n]))
    width = max(len(r) for r in rows)
    return Batch(inputs=mx.array(_pad(rows, width, 0), dtype=mx.int32),
                 targets=mx.array(_pad(targets, width, 0), dtype=mx.int32),
                 mask=mx.array(_pad(masks, width)), old_logprobs=mx.array(_pad(olds, width)),
                 ref_logprobs=mx.array(_pad(refs, width)),
                 advantages=mx.array([[s.advantage] for s in samples], dtype=mx.float32))


def token_logprobs(model: nn.Module, inputs: mx.array, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """log p(target | prefix) at every position, under the distribution the sampler used (logits / T)."""
    logits = model(inputs).astype(mx.float32)
    if temperature != 1.0:
        logits = logits / temperature
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - mx.logsumexp(logits, axis=-1)


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    temperature: float = 1.0


def grpo_loss(model: nn.Module, batch: Batch, total_tokens: float, cfg: LossConfig) -> tuple[mx.array, mx.array]:
    """(sum of token losses / total_tokens, [kl sum, clipped count, ratio sum, |logprob gap| sum,
    |logprob gap| max]) for one micro-batch. The gap is the trainer's logprob of each completion token
    against the sampler's: on-policy (the sampling version is the one being trained) it is the numerics
    gap between the trainer's forward and the engine's, per dtype."""
    new = token_logprobs(model, batch.inputs, batch.targets, cfg.temperature)
    ratio = mx.exp(new - batch.old_logprobs)
    adv = batch.advantages
    unclipped = ratio * adv
    clipped = mx.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    per_token = -mx.minimum(unclipped, clipped)
    delta = batch.ref_logprobs - new
    kl = mx.exp(delta) - delta - 1.0
    if cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * kl
    mask = batch.mask
    loss = (per_token * mask).sum() / total_tokens
    was_clipped = (clipped < unclipped).astype(mx.float32) * mask
    gap = mx.abs(new - batch.old_logprobs) * mask
    aux = mx.stack([(kl * mask).sum(), was_clipped.sum(), (ratio * mask).sum(), gap.sum(), gap.max()])
    return loss, mx.stop_gradient(aux)


class GRPOUpdater:
    """Accumulates the loss's gradients over micro-batches and takes one clipped Adam step."""

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, cfg: LossConfig, *,
                 micro_batch: int = 8, max_grad_norm: float = 1.0,
                 progress: Callable[[], None] | None = None) -> None:
        """`progress` is called after every micro-batch (the supervised trainer's heartbeat: an update of
        many micro-batches on a large model is minutes of work, not a stall)."""
        self.progress = progress or (lambda: None)
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.micro_batch = max(1, micro_batch)
        self.max_grad_norm = max_grad_norm
        self._loss_and_grad = nn.value_and_grad(model, self._loss)

    def _loss(self, batch: Batch, total_tokens: float) -> tuple[mx.array, mx.array]:
        return grpo_loss(self.model, batch, total_tokens, self.cfg)

    def step(self, samples: Sequence[Sample]) -> StepStats:
        """One optimizer step over `samples` (those with advantage 0 carry no gradient and are skipped)."""
        useful = [s for s in samples if s.advantage != 0.0 and s.completion_ids]
        total = float(sum(len(s.completion_ids) for s in useful))
        if not useful:
            return StepStats(tokens=0)
        self.model.train()
        grads = None
        loss_sum = 0.0
        aux_sum = mx.zeros((4,))
        gap_max = 0.0
        ordered = sorted(useful, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))  # less padding
        for i in range(0, len(ordered), self.micro_batch):
            batch = make_batch(ordered[i:i + self.micro_batch])
            (loss, aux), g = self._loss_and_grad(batch, total)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(loss, aux, grads)
            loss_sum += loss.item()
            self.progress()
            aux_sum = aux_sum + aux[:4]
            gap_max = max(gap_max, aux[4].item())
        if self.max_grad_norm > 0:
            grads, norm = optim.clip_grad_norm(grads, self.max_grad_norm)
        else:
            norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state, norm)
        self.model.eval()
        kl_sum, clipped, ratio_sum, gap_sum = aux_sum.tolist()
        return StepStats(loss=loss_sum, kl=kl_sum / total, clip_fraction=clipped / total,
                         ratio_mean=ratio_sum / total, grad_norm=float(norm.item()), tokens=int(total),
                         logprob_gap_mean=gap_sum / total, logprob_gap_max=gap_max)
