"""The adapter-version policy without a model pass: resolve's rules, hold vs reject, follow_latest."""

from __future__ import annotations

import pytest

from parallm.adapters import AdapterError, HeldRequests, VersionPolicy, save_bytes
from parallm.config import AdaptersConfig
from tests._adapter_helpers import adapter_tensors, lora_model
from tests._engine_helpers import greedy, make_engine, req, tiny_model


@pytest.fixture(scope="module")
def engine():
    ref = tiny_model("llama")
    config = lora_model(ref, rank=4)
    blob = save_bytes(adapter_tensors(ref))
    engine = make_engine(tiny_model("llama"))
    engine.adapters.history = 3
    for _ in range(4):  # versions 2, 3, 4 kept
        engine.load_adapter("pol", config=config, weights=blob)
    return engine


def refused(policy: VersionPolicy, *args) -> tuple[int, str]:
    with pytest.raises(AdapterError) as info:
        policy.resolve(*args)
    return info.value.status, info.value.code


def test_resolve_rules(engine):
    policy = engine.versions
    assert policy.resolve("") is None  # the base model
    assert policy.resolve("pol").version == 4
    assert policy.resolve("pol", 3).version == 3
    assert policy.resolve("pol", 2, 0, 2).version == 2
    assert refused(policy, "pol", 2, 0, 1) == (409, "version_unavailable")  # two behind, max_staleness 1
    assert refused(policy, "pol", 0, 5) == (409, "version_unavailable")  # min_version above the latest
    assert refused(policy, "pol", 3, 4) == (409, "version_unavailable")  # pinned below min_version
    assert refused(policy, "pol", 1) == (404, "adapter_not_found")  # no longer kept
    assert refused(policy, "other") == (404, "adapter_not_found")
    assert refused(policy, "", 0, 1) == (409, "version_unavailable")  # the base model is version 0
    engine.adapters.set_default("pol")
    try:
        assert policy.resolve("").version == 4  # the default policy
    finally:
        engine.adapters.set_default("")


def test_follow_latest_moves_only_running_unpinned_sequences(engine):
    engine.add_request(req("free", [3, 4, 5], greedy(30), adapter="pol", adapter_version=0))
    engine.add_request(req("pinned", [3, 4, 5], greedy(30), adapter="pol", adapter_version=3))
    engine.add_request(req("base", [3, 4, 5], greedy(30)))
    engine.step()
    free, pinned = engine._requests["free"][0], engine._requests["pinned"][0]
    assert engine.follow_latest() == 0  # already at the latest
    ref = tiny_model("llama")
    config = lora_model(ref, rank=4, seed=2)
    engine.load_adapter("pol", config=config, weights=save_bytes(adapter_tensors(ref)))
    assert engine.follow_latest() == 1
    assert (free.adapter_version, pinned.adapter_version) == (5, 3)
    assert free.adapter == f"pol@5+seq{free.seq_id}"  # KV of two versions: matches no other sequence
    for rid in ("free", "pinned", "base"):
        engine.abort(rid)
    engine.step()
    engine.check_integrity()


def test_hold_or_reject():
    now = [100.0]
    held: HeldRequests[str] = HeldRequests(AdaptersConfig(staleness_policy="hold", hold_timeout_s=5.0),
                                           clock=lambda: now[0])
    assert not held.hold("a", "A", status=404, min_version=2)  # not a missing version
    assert not held.hold("a", "A", status=409, min_version=0)  # no min_version: a pinned version went stale
    assert held.hold("a", "A", status=409, min_version=2)
    now[0] = 104.0
    [(since, request)] = held.take()
    assert (since, request, len(held)) == (100.0, "A", 0)
    assert held.hold("a", request, status=409, min_version=2, since=since)  # still within the timeout
    now[0] = 105.0
    [(since, request)] = held.take()
    assert not held.hold("a", request, status=409, min_version=2, since=since)  # timed out: refused
    assert held.hold("b", "B", status=409, min_version=1)
    assert held.rids() == ["b"] and held.pop("b") == "B" and held.pop("b") is None
    reject = HeldRequests(AdaptersConfig(staleness_policy="reject"))
    assert not reject.hold("a", "A", status=409, min_version=2)
