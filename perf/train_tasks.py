"""Tasks for timing the RL loop on random-weight models (perf/bench_train_share.py --shape ...): a random
model never stops, so the built-in tasks' rewards (0 for a reply cut off by max_tokens) are all equal and
no update would run. Here every reply gets a reward that varies from sample to sample; what it teaches
does not matter, only that each step trains."""

from __future__ import annotations

import random
from typing import Any, Sequence

from parallm.training.tasks import TaskPrompt

Conversation = list[dict[str, Any]]


class VowelShareTask:
    """Reward: the share of a reply's letters that are vowels (any reply, cut off or not)."""

    TOPICS = ("the sea", "a cat", "winter", "coffee", "the moon", "trains", "music", "rain")

    def __init__(self, **length_task_args: Any) -> None:
        """Takes (and ignores) the length task's arguments, so it can stand in for it in its config."""

    def sample(self, rng: random.Random) -> TaskPrompt:
        return TaskPrompt([{"role": "user", "content": f"Write about {rng.choice(self.TOPICS)}."}], {})

    def score(self, conversations: Sequence[Conversation], infos: Sequence[dict[str, Any]]) -> list[float]:
        out = []
        for conversation in conversations:
            reply = str(conversation[-1].get("content") or "")
            letters = [c for c in reply.lower() if c.isalpha()]
            out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
        return out
