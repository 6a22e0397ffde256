"""A served reward model as (part of) a task's reward: the trainer's task keeps its prompts, and each
group's conversations are scored in one batch by a pooling model the server serves beside the policy
(model.pooling, task reward), over the trainer's own ZeroMQ connection.

    reward = rl_training.task_reward_weight * task.score(...)
           + rl_training.reward_model_weight * served reward model's score
"""

from __future__ import annotations

import random
from typing import Any, Protocol, Sequence

from .tasks import Conversation, Task, TaskPrompt


class PoolingClient(Protocol):
    def pool(self, inputs: Sequence[Any], model: str, *, task: str = "embed", **spec: Any) -> list[list[float]]: ...


class WithRewardModel:
    """`task`'s prompts; its rewards blended with a served reward model's scores of the same conversations."""

    def __init__(self, task: Task, client: PoolingClient, model: str, *, task_weight: float = 1.0,
                 model_weight: float = 1.0) -> None:
        self.task, self.client, self.model = task, client, model
        self.task_weight, self.model_weight = task_weight, model_weight
        self.scores: list[float] = []  # the reward model's own scores since `take_scores` (the trainer's metrics)
        self.batches = 0               # pool() calls since then: one per group

    def sample(self, rng: random.Random) -> TaskPrompt:
        return self.task.sample(rng)

    def score(self, conversations: Sequence[Conversation], infos: Sequence[dict[str, Any]]) -> list[float]:
        scored = [float(r[0]) for r in self.client.pool([list(c) for c in conversations], self.model, task="reward")]
        self.scores += scored
        self.batches += 1
        from_task = self.task.score(conversations, infos) if self.task_weight else [0.0] * len(conversations)
        return [self.task_weight * float(t) + self.model_weight * r for t, r in zip(from_task, scored)]

    def take_scores(self) -> tuple[list[float], int]:
        """(the reward model's scores, pool() calls) since the last call."""
        taken = self.scores, self.batches
        self.scores, self.batches = [], 0
        return taken


def with_reward_model(task: Task, client: PoolingClient, model: str, task_weight: float,
                      model_weight: float) -> Task:
    """`task` itself when no reward model is named, else the blend."""
    if not model:
        return task
    return WithRewardModel(task, client, model, task_weight=task_weight, model_weight=model_weight)
