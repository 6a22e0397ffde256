"""/metrics with engine replicas (parallm/metrics.py): each engine number summed under its name, and per
replica in parallm_replica_<name>{replica="i"}, from replica 0's stats (which carry the others')."""

from __future__ import annotations

from parallm import protocol
from parallm.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_engine_numbers_are_summed_and_labelled_per_replica():
    metrics = ServerMetrics()
    second = protocol.EngineStats(replica=1, running=1, waiting=4, generated_tokens=50, prefix_queried_tokens=10,
                                  decode_batch_hist={4: 2}, adapters=protocol.AdapterStats(latest={"a": 2}))
    metrics.set_stats(protocol.EngineStats(replica=0, running=2, waiting=3, generated_tokens=70,
                                           prefix_queried_tokens=30, prefix_hit_tokens=15, decode_batch_hist={2: 3},
                                           adapters=protocol.AdapterStats(latest={"a": 3}), replicas=[second]))
    got = samples(metrics)
    assert got["parallm_num_requests_running"] == 3 and got["parallm_num_requests_waiting"] == 7
    assert got['parallm_replica_num_requests_waiting{replica="0"}'] == 3
    assert got['parallm_replica_num_requests_waiting{replica="1"}'] == 4
    assert got["parallm_generation_tokens_total"] == 120
    assert got['parallm_replica_generation_tokens_total{replica="1"}'] == 50
    assert got["parallm_prefix_cache_hit_rate"] == 15 / 40
    assert got['parallm_replica_prefix_cache_hit_rate{replica="0"}'] == 0.5
    assert got["parallm_decode_batch_size_count"] == 5
    assert got['parallm_adapter_version{adapter="a"}'] == 2  # the version every replica has
    assert got['parallm_replica_adapter_version{adapter="a",replica="0"}'] == 3


def test_one_engine_keeps_its_unlabelled_numbers():
    metrics = ServerMetrics()
    metrics.set_stats(protocol.EngineStats(running=2, waiting=1, adapters=protocol.AdapterStats(latest={"a": 1})))
    got = samples(metrics)
    assert got["parallm_num_requests_running"] == 2 and got['parallm_replica_num_requests_running{replica="0"}'] == 2
    assert got['parallm_adapter_version{adapter="a"}'] == 1


def test_speculative_decoding_counters_rates_and_k_distribution():
    metrics = ServerMetrics()
    spec = protocol.SpecStats(mode="ngram", verify_passes=5, rows_verified=8, proposed_tokens=20, accepted_tokens=12,
                              emitted_tokens=20, k_distribution={"2": 3, "4": 5})
    second = protocol.EngineStats(replica=1, spec=protocol.SpecStats(mode="ngram", rows_verified=2, proposed_tokens=4,
                                                                     accepted_tokens=0, k_distribution={"2": 2}))
    metrics.set_stats(protocol.EngineStats(replica=0, spec=spec, replicas=[second]))
    got = samples(metrics)
    assert got["parallm_spec_proposed_tokens_total"] == 24 and got["parallm_spec_accepted_tokens_total"] == 12
    assert got['parallm_replica_spec_verify_passes_total{replica="0"}'] == 5
    assert got["parallm_spec_acceptance_rate"] == 0.5 and got["parallm_spec_mean_accepted_tokens"] == 1.2
    assert got['parallm_spec_k{k="2"}'] == 5 and got['parallm_spec_k{k="4"}'] == 5
    off = ServerMetrics()
    off.set_stats(protocol.EngineStats())
    assert samples(off)["parallm_spec_acceptance_rate"] == 0.0
