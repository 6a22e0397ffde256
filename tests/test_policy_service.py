"""The policy stage's core without sockets: batching by rows and time, episodes' state and its TTL,
refusals naming the tensor, seeded replies equal to unbatched ones, and versioned weight updates."""

from __future__ import annotations

import numpy as np
import pytest

from parallm import protocol
from parallm.policies import Policy, save_policy
from parallm.policies.batcher import Batcher
from parallm.policies.episodes import EpisodeStore
from parallm.policies.service import PolicyService
from parallm.policies.tensors import unwire, wire
from tests._policy_helpers import MLP_CATEGORICAL, make_policies


@pytest.fixture()
def service(tmp_path) -> PolicyService:
    dirs = make_policies(tmp_path)
    return PolicyService({n: Policy.load(n, d) for n, d in dirs.items()}, max_batch=8, flush_us=1000,
                         episode_ttl_s=10.0, max_episodes=100)


def act(qid: str, obs: np.ndarray, model: str = "mlp", **fields) -> protocol.PolicyAct:
    return protocol.PolicyAct(qid=qid, model=model, inputs={"obs": wire(obs.astype(np.float32))}, **fields)


def test_batcher_flushes_on_rows_or_time():
    b: Batcher[str] = Batcher(max_batch=4, flush_us=100)
    b.add("m", "a", 1, now=0.0)
    b.add("m", "b", 2, now=0.00005)
    assert list(b.due(0.00009)) == [] and b.next_deadline() == pytest.approx(0.0001)
    assert list(b.due(0.0001)) == [("m", ["a", "b"])]
    b.add("m", "c", 3, now=1.0)
    b.add("m", "d", 2, now=1.0)
    assert list(b.due(1.0)) == [("m", ["c"])]      # full: c alone (c + d is over 4 rows)
    assert list(b.due(1.0, flush_all=True)) == [("m", ["d"])] and len(b) == 0


def test_batcher_keeps_one_episode_out_of_a_batch_twice():
    b: Batcher[str] = Batcher(max_batch=10, flush_us=0)
    b.add("m", "a", 1, 0.0, ("e1",))
    b.add("m", "b", 1, 0.0, ("e2",))
    b.add("m", "c", 1, 0.0, ("e1",))
    assert [items for _, items in b.due(0.0)] == [["a", "b"], ["c"]]


def test_episode_store_ttl_and_bound():
    store = EpisodeStore(ttl_s=5.0, max_entries=2)
    zeros = {"h": np.zeros(2)}
    store.scatter("m", ["e1"], {"h": np.array([[1.0, 2.0]])}, now=0.0)
    assert store.gather("m", ["e1", "e9"], [], zeros)["h"].tolist() == [[1, 2], [0, 0]]
    assert store.gather("m", ["e1"], [True], zeros)["h"].tolist() == [[0, 0]]   # an episode start
    store.scatter("m", ["e2", "e3"], {"h": np.ones((2, 2))}, now=3.0)
    assert len(store) == 2 and store.evicted == 1                                # e1 was the least recent
    assert store.expire(now=8.0) == 2 and len(store) == 0


def test_batched_replies_equal_unbatched(service):
    obs = np.random.default_rng(0).normal(size=(5, 4))
    for i in range(5):
        assert service.submit(b"c", act(f"q{i}", obs[i:i + 1], seed=100 + i), now=0.0) == []
    replies = service.run_due(now=1.0)
    assert [r.qid for _, r in replies] == [f"q{i}" for i in range(5)] and service.counts.batches == 1
    for i, (_, r) in enumerate(replies):
        service.submit(b"c", act("alone", obs[i:i + 1], seed=100 + i), now=2.0)
        (_, alone), = service.run_due(now=3.0)
        assert r.actions == alone.actions  # a row's action never depends on its batch (its own seed)
        for field in ("action_log_probs", "value_estimates"):  # a batched matmul may round its last bit apart
            np.testing.assert_allclose(unwire(field, getattr(r, field)), unwire(field, getattr(alone, field)),
                                       rtol=1e-6, atol=1e-7)
        assert r.version == 0 and unwire("a", r.actions).dtype == np.int64


def test_refusals_name_the_tensor(service):
    bad = [act("q1", np.ones((2, 5))), act("q2", np.full((1, 4), np.nan)),
           protocol.PolicyAct(qid="q3", model="mlp", inputs={}),
           protocol.PolicyAct(qid="q4", model="mlp", inputs={"obs": protocol.Tensor(dtype="float32", shape=[1, 4], data=b"x")}),
           act("q5", np.ones((1, 4)), model="nope"), act("q6", np.ones((1, 3)), model="reg"),
           act("q7", np.ones((2, 4)), model="lstm", episode_ids=["e", "e"])]
    out = {r.rid: r for m in bad for _, r in service.submit(b"c", m, 0.0)}
    assert {k: (r.status, r.param) for k, r in out.items()} == {
        "q1": (400, "obs"), "q2": (400, "obs"), "q3": (400, "obs"), "q4": (400, "obs"), "q5": (404, "model"),
        "q6": (400, "model"), "q7": (400, "episode_ids")}
    assert "NaN" in out["q2"].message and "missing" in out["q3"].message and "bytes" in out["q4"].message
    assert service.counts.rejected == 7 and len(service.batcher) == 0


def test_server_side_episode_state_equals_client_side(service):
    obs = np.random.default_rng(3).normal(size=(4, 2, 4))
    hidden: dict[str, protocol.Tensor] = {}
    for t in range(4):
        service.submit(b"c", act("srv", obs[t], model="lstm", episode_ids=["a", "b"],
                                 episode_starts=[t == 0, t == 0], deterministic=True), now=t)
        service.submit(b"c", act("cli", obs[t], model="lstm", hidden_states=hidden, deterministic=True), now=t)
        replies = dict((r.qid, r) for _, r in service.run_due(now=t + 1))
        hidden = replies["cli"].new_hidden_states
        assert replies["srv"].new_hidden_states == hidden and replies["srv"].actions == replies["cli"].actions
    assert len(service.episodes) == 2
    service.run_due(now=100.0)
    assert len(service.episodes) == 0 and service.stats().episodes_expired == 2


def test_predict_and_weight_updates(service, tmp_path):
    x = np.ones((3, 2), np.float32)
    service.submit(b"c", protocol.Predict(qid="p", model="reg", inputs={"x": wire(x), "k": wire(np.arange(3))}), 0.0)
    (_, reply), = service.run_due(1.0)
    assert unwire("y", reply.outputs["y"]).shape == (3, 3) and reply.version == 0
    other = Policy.load("o", save_policy(tmp_path / "other", MLP_CATEGORICAL, seed=77))
    assert service.update_weights(protocol.PolicyWeights(model="mlp", weights=other.weights_bytes())) == ""
    assert service.update_weights(protocol.PolicyWeights(model="mlp", version=1, weights=b"")) != ""   # not newer
    assert "missing" in service.update_weights(protocol.PolicyWeights(model="mlp", version=5,
                                                                      weights=service.policies["reg"].weights_bytes()))
    service.submit(b"c", act("a", np.ones((1, 4)), deterministic=True), 2.0)
    (_, reply), = service.run_due(3.0)
    assert reply.version == 1
    direct = other.act({"obs": np.ones((1, 4), np.float32)}, {}, np.zeros(1, np.uint64), np.ones(1, bool))
    assert unwire("a", reply.actions).tolist() == direct.actions.tolist()
    stats = service.stats()
    assert stats.weights_updates == 1 and stats.weights_rejected == 2 and stats.versions["mlp"] == 1
    assert {p.name: p.action for p in service.describe()} == {"mlp": "categorical", "lstm": "categorical",
                                                             "gauss": "gaussian", "reg": ""}


def test_a_full_queue_refuses_with_a_retryable_503(tmp_path):
    dirs = make_policies(tmp_path)
    service = PolicyService({"mlp": Policy.load("mlp", dirs["mlp"])}, max_batch=4, flush_us=10**6,
                            episode_ttl_s=10.0, max_episodes=10, max_queued_rows=6)
    assert service.submit(b"c", act("a", np.ones((4, 4))), 0.0) == []
    (_, refused), = service.submit(b"c", act("b", np.ones((3, 4))), 0.0)
    assert refused.status == 503 and refused.retryable and refused.code == "overloaded"
    assert [r.qid for _, r in service.run_due(0.0)] == ["a"]
