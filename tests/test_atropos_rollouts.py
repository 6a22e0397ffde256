"""Atropos ScoredData groups (atroposlib 0.4.0 api/server.py's ScoredData: tokens, masks with -100 on
the prompt, scores, optional inference_logprobs) to the trainer's Groups."""

from __future__ import annotations

from parallm.config import RLTrainingConfig
from parallm.training.atropos import AtroposRollouts


def source(scored: list) -> AtroposRollouts:
    def score(ids, start):
        scored.append((list(ids), start))
        return [-0.5] * (len(ids) - start)

    return AtroposRollouts("http://127.0.0.1:1", cfg=RLTrainingConfig(), decode=lambda ids: " ".join(map(str, ids)),
                           score=score, version=lambda: 7, checkpoint_dir="/tmp/x")


def test_a_scored_group_becomes_a_group_with_the_environments_rewards():
    scored: list = []
    data = {"tokens": [[1, 2, 3, 10, 11], [1, 2, 3, 12]], "masks": [[-100, -100, -100, 10, 11], [-100, -100, -100, 12]],
            "scores": [1.0, 0.0], "inference_logprobs": [[1.0, 1.0, 1.0, -0.1, -0.2], None], "env_id": 3}
    group = source(scored)._group(data)
    assert group.prompt_ids == [1, 2, 3] and group.scores == [1.0, 0.0] and group.info == {"env_id": 3}
    first, second = group.completions
    assert first.ids == [10, 11] and first.logprobs == [-0.1, -0.2] and first.versions == [(0, 7)]
    assert second.ids == [12] and second.logprobs == [-0.5]            # no inference logprobs: scored here
    assert scored == [([1, 2, 3, 12], 3)]


def test_sequences_with_another_prompt_or_nothing_trained_are_skipped():
    rollouts = source([])
    data = {"tokens": [[1, 2, 9], [1, 2, 8], [5, 2, 7], [1, 2]], "masks": [[-100, -100, 9], [-100, -100, 8],
                                                                         [-100, -100, 7], [-100, -100]],
            "scores": [1.0, 0.5, 0.0, 0.0]}
    group = rollouts._group(data)
    assert [c.ids for c in group.completions] == [[9], [8]] and rollouts.skipped == 2
    assert rollouts._group({"tokens": [[1, 5]], "masks": [[-100, 5]], "scores": [1.0]}) is None   # one sequence
