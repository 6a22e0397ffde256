"""A full-weight update on an engine with adapters loaded: the adapters keep applying on top of the new
base weights, as vLLM's and SGLang's LoRA adapters do (a delta kept apart from the base; vLLM 0.31's
LoRA layers wrap the base layer whose weights a reload replaces, SGLang 0.5.23's update_weights_from_disk
loads into the same wrapped layers). So after the update an adapter's greedy output equals that of a
fresh engine on the new weights with the same adapter loaded: factored LoRA as it is, a version merged
into copies of base weights folded again, DoRA's gains computed from the new weights."""

from __future__ import annotations

import pytest
from mlx.utils import tree_flatten

from _adapter_helpers import adapter_tensors, lora_model
from _engine_helpers import greedy, make_engine, req, run_all, tiny_model
from parallm.adapters import save_bytes

PROMPT = list(range(5, 30))


def tokens(engine, adapter: str = "") -> list[int]:
    out = run_all(engine, [req(f"r-{adapter}", PROMPT, greedy(10), adapter=adapter)])
    return out[(f"r-{adapter}", 0)]["tokens"]


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("merge_mb", [64, 0], ids=["merged", "factored"])
def test_adapters_keep_applying_on_top_of_the_new_weights(dora, merge_mb):
    trained = tiny_model("llama", 0)
    config = lora_model(trained, dora=dora)
    blob = save_bytes(adapter_tensors(trained))
    new_weights = dict(tree_flatten(tiny_model("llama", 1).parameters()))

    served = make_engine(tiny_model("llama", 0), adapter_merge_mb=merge_mb, kv_budget_bytes=16 << 20)
    loaded = served.load_adapter("pol", config=config, weights=blob)
    assert loaded.merged == bool(merge_mb)
    before = tokens(served, "pol")
    served.update_weights(tensors=new_weights)
    assert served.adapters.latest("pol").merged == bool(merge_mb)      # a merged version stays merged

    fresh = make_engine(tiny_model("llama", 1), adapter_merge_mb=merge_mb, kv_budget_bytes=16 << 20)
    fresh.load_adapter("pol", config=config, weights=blob)
    after = tokens(served, "pol")
    assert after == tokens(fresh, "pol") and after != before
    assert tokens(served) == tokens(fresh)                              # and the base model alone
