"""The prefix cache's disk tier in the engine (engine/prefix_tier.py): blocks written through or on
eviction are read back on a miss, by the same engine or by a new one on the same directory (a
restart), and give exactly the tokens a cold run gives; a corrupt file is recomputed, dropped and
counted; another model never reads them; check_integrity holds throughout."""

from __future__ import annotations

import pytest

from parallm.config import Config, EngineConfig, KVConfig
from parallm.engine import Engine, EngineModel
from tests._engine_helpers import greedy, reference_greedy, req, run_all, tiny_model

PROMPT = [(i * 7) % 97 + 1 for i in range(41)]  # 10 full blocks of 4, one token left to prefill


def disk_engine(tmp_path, policy: str = "write_through", *, seed: int = 0, budget_mb: float = 2.0,
                **kv) -> Engine:
    config = Config(engine=EngineConfig(kv_budget_mb=budget_mb, block_size=4),
                    kv=KVConfig(disk_dir=str(tmp_path), disk_policy=policy, **kv))
    return Engine(EngineModel(tiny_model("llama", seed), (), 512), config)


def serve(engine: Engine, rid: str, prompt: list[int], max_tokens: int = 6) -> list[int]:
    out = run_all(engine, [req(rid, prompt, greedy(max_tokens))])
    engine.check_integrity()
    return out[(rid, 0)]["tokens"]


@pytest.mark.parametrize("policy", ["write_through", "evict_only"])
def test_a_restarted_engine_reads_the_prefix_back_from_disk(tmp_path, policy):
    first = disk_engine(tmp_path, policy)
    cold = serve(first, "a", PROMPT)
    assert cold == reference_greedy(tiny_model("llama"), PROMPT, 6)
    first.close()
    assert first.stats().kv_disk.written >= 10
    second = disk_engine(tmp_path, policy)
    assert serve(second, "b", PROMPT) == cold
    stats = second.stats()
    assert stats.kv_disk.hits == 10 and stats.prefix_hit_tokens == 40
    assert stats.prompt_tokens_computed == 1
    second.close()


def test_evicted_blocks_come_back_from_disk_in_the_same_engine(tmp_path):
    engine = disk_engine(tmp_path, "evict_only", budget_mb=0.1)  # a store of 51 blocks of 4 tokens
    assert engine.blocks.num_blocks == 51 and engine.blocks.max_cached == 12  # a quarter stays cached
    cold = serve(engine, "a", PROMPT)
    others = [[(i * 13 + k) % 97 + 1 for i in range(41)] for k in range(1, 4)]
    for k, other in enumerate(others):
        serve(engine, f"o{k}", other)  # evicts PROMPT's blocks from the store
    engine.disk_tier.disk.flush()
    assert engine.stats().kv_disk.written >= 10
    hits = engine.stats().kv_disk.hits
    assert serve(engine, "again", PROMPT) == cold
    assert engine.stats().kv_disk.hits - hits == 10
    engine.close()


def test_a_corrupt_file_is_recomputed_dropped_and_counted(tmp_path):
    first = disk_engine(tmp_path)
    cold = serve(first, "a", PROMPT)
    first.close()
    files = sorted(first.disk_tier.disk.dir.rglob("*.kv"), key=lambda p: p.stat().st_mtime)
    victim = files[4]
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF
    victim.write_bytes(bytes(data))
    second = disk_engine(tmp_path)
    assert serve(second, "b", PROMPT) == cold
    stats = second.stats().kv_disk
    assert stats.corrupt_files == 1 and stats.hits < 10  # the chain stops there; the rest is recomputed
    second.close()
    assert victim.read_bytes() != bytes(data)  # deleted, then written through again from the recomputed KV
    third = disk_engine(tmp_path)
    assert serve(third, "c", PROMPT) == cold and third.stats().kv_disk.hits == 10
    third.close()


def test_another_model_never_reads_the_blocks(tmp_path):
    first = disk_engine(tmp_path, seed=0)
    serve(first, "a", PROMPT)
    first.close()
    other = disk_engine(tmp_path, seed=1)
    assert other.disk_tier.disk.fingerprint != first.disk_tier.disk.fingerprint
    assert serve(other, "b", PROMPT) == reference_greedy(tiny_model("llama", 1), PROMPT, 6)
    assert other.stats().kv_disk.hits == 0
    other.close()


def test_warm_up_writes_nothing_to_disk(tmp_path):
    engine = disk_engine(tmp_path)
    engine.warm_up()
    engine.close()
    assert engine.stats().kv_disk.written == 0 and not list(engine.disk_tier.disk.dir.rglob("*.kv"))
