"""Admission by KV pressure (engine/pressure.py, kv.pressure_threshold): a burst past the threshold is
taken up to it and refused beyond with a retryable 503, the taken ones finish without preemptions, the
engine's stats, /health and /metrics say how full the KV is."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.config import Config, ConfigError, EngineConfig, KVConfig, ServerConfig, build_config
from parallm.engine import Engine, EngineModel, RequestRejected
from parallm.engine.pressure import KVLoad, PressureGate, pressure_state
from parallm.metrics import ServerMetrics
from parallm.protocol import EngineStats, KVDiskStats
from tests._engine_helpers import greedy, req, run_all, tiny_model


def pressure_engine(threshold: float | None) -> Engine:
    config = Config(engine=EngineConfig(kv_budget_mb=0.1, block_size=4),
                    kv=KVConfig(pressure_threshold=threshold))
    return Engine(EngineModel(tiny_model("llama"), (), 512), config)


def test_a_burst_past_the_threshold_is_refused_with_a_retryable_503(engines):
    engine = pressure_engine(0.5)
    engines.append(engine)
    slots = engine.budget.budget_tokens
    taken, refused = [], []
    for i in range(20):
        prompt = [(i * 31 + j) % 97 + 1 for j in range(30)]
        try:
            engine.add_request(req(f"r{i}", prompt, greedy(4)))
            taken.append(f"r{i}")
        except RequestRejected as exc:
            assert (exc.status, exc.code, exc.retryable) == (503, "kv_pressure", True)
            refused.append(f"r{i}")
    assert len(taken) == int(0.5 * slots) // 30 and len(refused) == 20 - len(taken)
    stats = engine.stats()
    assert stats.kv_pressure == "overloaded" and stats.kv_pressure_rejections == len(refused)
    assert stats.kv_waiting_tokens == 30 * len(taken) and stats.kv_capacity_tokens >= slots
    out = run_all(engine)
    assert sorted(rid for rid, _ in out) == sorted(taken) and all(d["finish"] == "length" for d in out.values())
    assert engine.stats().preemptions == 0
    engine.add_request(req("after", [5] * 30, greedy(2)))  # the pressure is gone with the work
    run_all(engine)
    engine.pressure.clock = lambda: float("inf")  # long after the last refusal
    assert engine.stats().kv_pressure == "ok"


def test_an_empty_engine_takes_any_request_and_no_threshold_refuses_nothing(engines):
    engine = pressure_engine(0.01)
    engines.append(engine)
    engine.add_request(req("big", [3] * 60, greedy(2)))  # alone: always taken
    with pytest.raises(RequestRejected):
        engine.add_request(req("more", [4] * 10, greedy(2)))
    run_all(engine)
    free = pressure_engine(None)
    engines.append(free)
    for i in range(30):
        free.add_request(req(f"r{i}", [i + 1] * 30, greedy(1)))
    assert free.stats().kv_pressure == "ok" and free.stats().kv_demand > 1
    run_all(free)


def test_pressure_states():
    assert pressure_state(0.99, None) == "ok"
    assert [pressure_state(d, 0.8) for d in (0.5, 0.75, 0.8, 0.81)] == ["ok", "degraded", "degraded", "overloaded"]
    assert pressure_state(0.1, 0.8, refused_recently=True) == "overloaded"
    gate = PressureGate(0.5)
    gate.admit(KVLoad(0, 0, 100), 500)  # empty: taken
    gate.admit(KVLoad(20, 20, 100), 10)
    with pytest.raises(RequestRejected):
        gate.admit(KVLoad(20, 20, 100), 11)
    assert gate.rejected == 1


def test_the_kv_section_is_typed_and_checked():
    config = build_config(environ={}, cli={"kv": {"disk_dir": "/tmp/x", "disk_policy": "write_through",
                                                  "pressure_threshold": 0.9}})
    assert config.kv.disk_policy == "write_through" and config.kv.pressure_threshold == 0.9
    for bad in ({"pressure_threshold": 1.5}, {"disk_policy": "sometimes"}, {"disk_max_gb": 0}):
        with pytest.raises(ConfigError):
            build_config(environ={}, cli={"kv": bad})


class _Backend:
    """Only what the health routes ask of a backend: ingress's answer for an engine at this pressure."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def health(self):
        return self.state

    def __getattr__(self, name):
        raise AttributeError(name)


@pytest.mark.parametrize("state,code,ready", [
    ({"status": "degraded", "serving": True, "ready": False}, 200, 503),   # near the threshold
    ({"status": "overloaded", "serving": True, "ready": False}, 200, 503),  # past it: refusing
    ({"status": "degraded", "serving": False, "ready": False}, 503, 503),  # a stage is down
])
def test_health_from_kv_pressure(state, code, ready):
    app = TestClient(build_app(_Backend(state), ServerConfig()))
    assert app.get("/health").status_code == code and app.get("/readyz").status_code == ready


def test_metrics_export_kv_capacity_utilization_and_the_disk_tier():
    metrics = ServerMetrics()
    metrics.set_stats(EngineStats(kv_capacity_tokens=4096, live_token_slots=3072, kv_live_tokens=1536,
                                  kv_waiting_tokens=768, kv_pressure_rejections=3,
                                  kv_disk=KVDiskStats(hits=10, misses=2, read_bytes=100, written_bytes=200,
                                                      corrupt_files=1, bytes=300, files=4)))
    text = metrics.render().decode()
    for line in ("parallm_kv_capacity_tokens 4096.0", "parallm_kv_utilization 0.5", "parallm_kv_demand 0.75",
                 "parallm_kv_pressure_rejections_total 3.0", "parallm_kv_disk_hits_total 10.0",
                 "parallm_kv_disk_misses_total 2.0", "parallm_kv_disk_read_bytes_total 100.0",
                 "parallm_kv_disk_corrupt_files_total 1.0", "parallm_kv_disk_bytes 300.0"):
        assert line in text, line
