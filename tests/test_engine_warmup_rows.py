"""engine.warm_decode_rows: the warm-up decodes every row count up to it, and leaves nothing behind."""

from __future__ import annotations

import pytest

from parallm.config import Config, ConfigError, EngineConfig, build_config
from parallm.engine.warmup import warm_up_decode_rows
from tests._engine_helpers import greedy, make_engine, run_all, tiny_model
from parallm.engine import make_request


def _decode_rows_seen(engine) -> list[int]:
    seen = []
    record = engine.trace.decode
    engine.trace.decode = lambda rows: (seen.append(rows), record(rows))
    return seen


@pytest.mark.parametrize("overlap", [False, True])
def test_the_warm_up_decodes_every_row_count_up_to_the_setting_and_leaves_nothing(overlap):
    engine = make_engine(tiny_model("llama"), warm_decode_rows=12, max_num_seqs=16, overlap=overlap, block_size=8,
                         mixed_passes=False)
    seen = _decode_rows_seen(engine)
    engine.warm_up()
    assert set(range(1, 13)) <= set(seen) and max(seen) == 12
    assert not engine.has_work() and engine.blocks.num_cached == 0
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and engine.counters.steps == 0  # counters reset after the warm-up
    # and the engine serves as before: greedy tokens equal to an engine that did not ramp
    plain = make_engine(tiny_model("llama"), max_num_seqs=16, overlap=overlap, block_size=8, mixed_passes=False)
    reqs = lambda: [make_request(rid=f"r{i}", prompt_ids=list(range(3 + i, 20 + i)), params=greedy(6)) for i in range(3)]
    assert run_all(engine, reqs()) == run_all(plain, reqs())


def test_the_ramp_stops_at_max_num_seqs_and_at_zero_does_nothing():
    engine = make_engine(tiny_model("llama"), max_num_seqs=4, mixed_passes=False)
    seen = _decode_rows_seen(engine)
    assert warm_up_decode_rows(engine, 50) == 4 and max(seen) == 4
    seen.clear()
    assert warm_up_decode_rows(engine, 0) == 0 and seen == []


def test_unset_is_none_and_a_negative_count_is_refused():
    assert Config(engine=EngineConfig()).engine.warm_decode_rows is None
    assert build_config(environ={}, overrides={"engine": {"warm_decode_rows": 8}}).engine.warm_decode_rows == 8
    with pytest.raises(ConfigError, match="warm_decode_rows"):
        build_config(environ={}, overrides={"engine": {"warm_decode_rows": -1}})
