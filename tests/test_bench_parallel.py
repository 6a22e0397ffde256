"""perf/bench_parallel.py's run sizes and perf/parallel_adapters.py's reading of per-replica, per-rank versions."""

from __future__ import annotations

from parallm import protocol
from perf.bench_parallel import requests_at
from perf.parallel_adapters import NAME, lora_tensors, served_versions


def test_each_run_is_sized_by_its_concurrency():
    assert requests_at(1, 4, 4) == 4
    assert requests_at(64, 4, 4) == 256
    assert requests_at(256, 1024, 0) == 1024
    assert requests_at(8, 2, 0) == 8  # never fewer requests than streams


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
