"""The engine process's pooling queue (parallm/engine/pooling_queue.py): validation, priority order, batches
under the token budget, aborts, Matryoshka truncation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parallm.engine.request import RequestRejected
from parallm.pooling.load import load_pooling_model
from parallm.engine.pooling_queue import PoolingQueue
from parallm.protocol import PoolingSpec
from tests._pooling_helpers import write_decoder


@pytest.fixture(scope="module")
def queue(tmp_path_factory) -> PoolingQueue:
    root: Path = tmp_path_factory.mktemp("pq")
    emb = load_pooling_model(str(write_decoder(root / "emb", "embed", extra={"matryoshka_dimensions": [16]})[0]),
                             name="emb")
    rm = load_pooling_model(str(write_decoder(root / "rm", "seqcls", seed=2)[0]), name="rm")
    return PoolingQueue({"emb": emb, "rm": rm}, batch_tokens=12)


EMB, RM = PoolingSpec(model="emb"), PoolingSpec(model="rm", task="reward")


@pytest.mark.parametrize("ids, spec, status, text", [
    ([1, 2], PoolingSpec(model="nope"), 404, "not served (served: emb, rm)"),
    ([1, 2], PoolingSpec(model="rm"), 400, "is a reward model, not embed"),
    ([], EMB, 400, "empty"),
    ([1] * 40000, EMB, 400, "at most"),
    ([10**7], EMB, 400, "outside emb's vocabulary"),
    ([1], PoolingSpec(model="emb", dimensions=20), 400, "one of [16]"),
])
def test_refused(queue: PoolingQueue, ids, spec, status, text) -> None:
    with pytest.raises(RequestRejected) as err:
        queue.add("r", ids, spec)
    assert err.value.status == status and text in err.value.message


def test_priority_model_and_budget_make_the_batches(queue: PoolingQueue) -> None:
    queue.add("late", [1, 2, 3], EMB, priority=5)
    queue.add("a", [4, 5, 6], EMB)
    queue.add("r1", [7, 8], RM)
    queue.add("b", [9, 10, 11], EMB)
    queue.add("c", [12, 13, 14], EMB)
    queue.add("gone", [1], EMB)
    assert queue.abort("gone") and not queue.abort("gone") and len(queue) == 5
    first = queue.step()  # the best job (a) and more of its model within 12 padded tokens: a, b, c, then late
    assert [p.rid for p in first] == ["a", "b", "c", "late"]
    assert [p.rid for p in queue.step()] == ["r1"] and queue.step() == [] and len(queue) == 0
    assert first[0].vector.shape == (64,) and first[0].prompt_tokens == 3
    assert abs(np.linalg.norm(first[0].vector) - 1) < 1e-5


def test_dimensions_truncate_and_renormalize(queue: PoolingQueue) -> None:
    queue.add("full", [3, 4, 5], EMB)
    queue.add("cut", [3, 4, 5], PoolingSpec(model="emb", dimensions=16))
    out = {p.rid: p.vector for p in queue.step()}
    assert out["cut"].shape == (16,)
    assert np.allclose(out["cut"], out["full"][:16] / np.linalg.norm(out["full"][:16]), atol=1e-6)
