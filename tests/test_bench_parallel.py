"""perf/bench_parallel.py's run sizes and per-replica counts, perf/loadgen.py's steady-state window, and
perf/parallel_adapters.py's reading of per-replica, per-rank versions."""

from __future__ import annotations

from parallm import protocol
import pytest

from perf.bench_parallel import load_line, parse_layout, rank_delta, ranks_line, replica_delta, requests_at
from perf.loadgen import RequestRecord, steady_state
from perf.parallel_adapters import NAME, lora_tensors, served_versions


def test_each_run_is_sized_by_its_concurrency():
    assert requests_at(1, 4, 4) == 4
    assert requests_at(64, 4, 4) == 256
    assert requests_at(256, 1024, 0) == 1024
    assert requests_at(8, 2, 0) == 8  # never fewer requests than streams


def record(started: float, ttft: float, tokens: int, gap: float) -> RequestRecord:
    return RequestRecord(ok=True, tokens=tokens, ttft=ttft, latency=ttft + gap * (tokens - 1),
                         itls=[gap] * (tokens - 1), started=started)


def test_the_steady_window_leaves_out_ramp_up_and_tail():
    # two streams, two requests each of 5 tokens 0.25 s apart, sent at T + 0, 0, 2 and 3 s
    t = 1000.0
    records = [record(t, 1.0, 5, 0.25), record(t, 2.0, 5, 0.25),  # tokens 1..2 and 2..3 s
               record(t + 2, 0.5, 5, 0.25), record(t + 3, 0.5, 5, 0.25)]  # 2.5..3.5 and 3.5..4.5 s
    steady = steady_state(records, concurrency=2)
    assert steady["steady_from_s"] == 2.0  # both streams have their first token
    assert steady["steady_window_s"] == 1.5  # until the first end after the last send (3.5 s)
    # in [2, 3.5): the first request's last token, the second's 5, the third's first 4, none of the fourth's
    assert abs(steady["steady_tok_s"] * 1.5 - 10) < 1e-9
    assert steady_state(records[:3], concurrency=2) == {}  # fewer than two requests per stream
    assert steady_state([RequestRecord(ok=True, tokens=3)] * 4, concurrency=2) == {}  # no send times


def test_per_replica_counts_are_the_runs_own():
    before = {"requests": [3, 4], "tokens": [10, 20], "steps": [1, 1], "phase_s": [{"read": 1.0}, {}],
              "decode_batches": [{8: 2}, {}]}
    after = {"requests": [13, 14], "tokens": [110, 220], "steps": [5, 9], "phase_s": [{"read": 3.0}, {"read": 1.0}],
             "decode_batches": [{8: 2, 4: 1, 2: 1}, {16: 4}]}
    split = replica_delta(before, after, wall_s=4.0)
    assert split == {"requests": [10, 10], "tokens": [100, 200], "steps": [4, 8], "phase_s": [{"read": 2.0}, {"read": 1.0}],
                     "busy": [0.5, 0.25], "decode_batch_mean": [3.0, 16.0]}
    line = load_line({"per_replica": split, "cpu_s": {"ingress": 0.5}, "cpu_us_per_token": {"ingress": 1666.7},
                      "wall_s": 4.0})
    assert "requests per replica [10, 10], tokens [100, 200]" in line
    assert "ingress 0.50 s (1667 us/token, 12% of a core)" in line


def test_served_versions_name_every_replica_and_rank():
    ranks = [protocol.RankState(rank=r, step=9, policy={NAME: 3, "": 0}) for r in range(2)]
    second = protocol.EngineStats(replica=1, ranks=ranks)
    stats = protocol.EngineStats(replica=0, adapters=protocol.AdapterStats(latest={NAME: 4}), replicas=[second])
    assert served_versions(stats) == [{"replica": 0, "rank": 0, "version": 4},
                                      {"replica": 1, "rank": 0, "version": 3, "step": 9, "agrees": True},
                                      {"replica": 1, "rank": 1, "version": 3, "step": 9, "agrees": True}]


def test_the_published_lora_fits_the_model(tmp_path):
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tests._engine_helpers import tiny_model

    model = tiny_model("llama")
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                                                          intermediate_size=128, num_attention_heads=4,
                                                          num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=101)))
    config, tensors = lora_tensors(tmp_path, seed=0)
    assert config["num_layers"] == 2
    assert tensors["model.layers.1.self_attn.o_proj.lora_a"].shape == (64, 8)
    assert tensors["model.layers.0.self_attn.q_proj.lora_b"].shape == (8, 64)
    assert len(tensors) == 8


def test_a_layout_may_carry_its_own_concurrency_levels():
    assert parse_layout("2x1", [1, 64]) == ("2x1", [1, 64])
    assert parse_layout("1x2@256", [1, 64]) == ("1x2", [256])
    assert parse_layout("1x1@1/64/128/256", [8]) == ("1x1", [1, 64, 128, 256])
    with pytest.raises(ValueError):
        parse_layout("0x1", [1])


def test_each_ranks_phases_over_a_run_are_the_difference_of_two_readings():
    before = [{"rank": 0, "steps": 10, "phase_s": {"plan": 0.01, "read": 0.1}, "collective_us": {"all_sum_1row": 30.0}},
              {"rank": 1, "steps": 10, "phase_s": {"wait": 0.2}, "collective_us": {}}]
    after = [{"rank": 0, "steps": 110, "phase_s": {"plan": 0.06, "read": 1.1, "launch": 0.5},
              "collective_us": {"all_sum_1row": 30.0}},
             {"rank": 1, "steps": 60, "phase_s": {"wait": 0.7}, "collective_us": {}}]
    ranks = rank_delta(before, after)
    assert ranks[0] == {"rank": 0, "steps": 100, "collective_us": {"all_sum_1row": 30.0},
                        "step_ms_mean": {"plan": 0.5, "read": 10.0, "launch": 5.0}}
    assert ranks[1]["steps"] == 50 and ranks[1]["step_ms_mean"] == {"wait": 10.0}
    line = ranks_line({"ranks": ranks})
    assert "rank 0 (100 steps): plan 0.50, read 10.00, launch 5.00" in line and "all_sum_1row" in line
