"""Several versions of one adapter in one batch (a trainer publishing while rollouts run): the
mixed plan's stacks are found again whatever the rows' order, its dense update equals each row's
own adapter applied alone, and versions published mid-run share packed passes with older rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from parallm.adapters import save_bytes
from parallm.adapters import lora
from parallm.adapters.lora import _Single
from tests._engine_helpers import greedy, make_engine, req, run_all, tiny_model

KEYS = ("q_proj", "o_proj")


def _version(model, seed: int, rank: int = 4) -> tuple[dict, bytes]:
    mx.random.seed(seed)
    w = {}
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in KEYS:
            lin = getattr(module, "linear", module)
            o, i = lin.weight.shape
            w[f"{path}.lora_a"] = mx.random.normal((i, rank)) * 0.3
            w[f"{path}.lora_b"] = mx.random.normal((rank, o)) * 0.3
    return {"fine_tune_type": "lora", "num_layers": -1,
            "lora_parameters": {"rank": rank, "scale": 2.0, "dropout": 0.0}}, save_bytes(w)


# a set's update is dense up to DENSE_COLUMNS slots x rank, per-row gather_mm past it
FORMS = pytest.mark.parametrize("dense_columns", [lora.DENSE_COLUMNS, 0], ids=["dense", "gather"])


@FORMS
def test_a_set_of_versions_keeps_its_stacks_whatever_the_row_order_and_rows_get_their_own_update(
        dense_columns, monkeypatch):
    monkeypatch.setattr(lora, "DENSE_COLUMNS", dense_columns)
    model = tiny_model("llama")
    engine = make_engine(model, adapter_merge_mb=0)
    v = [engine.load_adapter("pol", config=c, weights=b) for c, b in (_version(model, s, r) for s, r in
                                                                          ((1, 4), (2, 8), (3, 4)))]
    router = engine.adapters.router
    x = mx.array([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]])
    rows = [v[0], None, v[2], v[1]]
    outs = []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        router.bind([rows[i] for i in order])
        out = model(x[mx.array(order)])
        router.unbind()
        outs.append(out[mx.array(np.argsort(order))])
    assert len(router._stacks) == 1  # one set of versions, one set of stacks
    A = next(iter(router._stacks.values())).by_path["model.layers.0.self_attn.q_proj"][0]
    assert A.ndim == (2 if dense_columns else 3)
    for out in outs[1:]:
        assert mx.allclose(out, outs[0], atol=1e-5, rtol=1e-5).item()
    for i, adapter in enumerate(rows):  # each row as its adapter alone would compute it (factored)
        router.plan = None if adapter is None else _Single(adapter)
        alone = model(x[i:i + 1])
        router.unbind()
        assert mx.allclose(outs[0][i:i + 1], alone, atol=1e-4, rtol=1e-4).item(), i


def _run(mixed_passes: bool) -> tuple[dict, dict, object]:
    """Streams under version 1; versions 2 and 3 published while they run, with requests arriving
    under each (their prompts prefilled beside the older rows' decode tokens)."""
    model = tiny_model("llama")
    engine = make_engine(model, mixed_passes=mixed_passes, max_prefill_tokens=24, adapter_merge_mb=0)
    engine.adapters.history = 8
    bind = engine.adapters.router.bind
    engine.packed_mixes = 0

    def counting_bind(adapters, packed=False):
        engine.packed_mixes += packed and len({id(a) for a in adapters}) > 1
        bind(adapters, packed)

    engine.adapters.router.bind = counting_bind
    versions = {k: _version(model, 10 + k) for k in (1, 2, 3)}
    engine.load_adapter("pol", config=versions[1][0], weights=versions[1][1])
    for i in range(3):
        engine.add_request(req(rid=f"v1-{i}", prompt_ids=[3 + i, 4, 5, 6], params=greedy(14, logprobs=True),
                               adapter="pol"))
    arrivals = {}
    for k, step in ((2, 3), (3, 7)):
        arrivals[step] = [req(rid=f"v{k}-{i}", prompt_ids=[20 + i, 21, 22, 23, 24][:3 + i],
                              params=greedy(10, logprobs=True), adapter="pol") for i in range(2)]
    seen: dict[tuple[str, int], set] = {}
    results: dict = {}
    step = 0
    while engine.has_work() or step <= 7:
        if step in arrivals:
            k = 2 if step == 3 else 3
            engine.load_adapter("pol", config=versions[k][0], weights=versions[k][1])
            for r in arrivals[step]:
                engine.add_request(r)
        for o in engine.step():
            d = results.setdefault(o.rid, {"tokens": [], "logprobs": []})
            d["tokens"] += o.token_ids
            d["logprobs"] += o.logprobs or []
            if o.token_ids:
                seen.setdefault((o.rid, o.version), set())
        step += 1
    return results, seen, engine


@FORMS
def test_versions_published_mid_run_share_packed_passes_and_keep_each_rows_tokens_and_version(
        dense_columns, monkeypatch):
    monkeypatch.setattr(lora, "DENSE_COLUMNS", dense_columns)
    packed, seen, engine = _run(mixed_passes=True)
    assert engine.packed_mixes >= 2  # packed passes whose tokens ran under several versions
    separate, seen_separate, other = _run(mixed_passes=False)
    assert other.stats().mixed_passes == 0
    assert packed.keys() == separate.keys() and len(packed) == 7
    for rid, want in separate.items():
        assert packed[rid]["tokens"] == want["tokens"], rid
        np.testing.assert_allclose(packed[rid]["logprobs"], want["logprobs"], rtol=1e-4, atol=1e-5)
    # every token reports the version its request started under
    assert seen == seen_separate == {(rid, int(rid[1])): set() for rid in packed}
    # and equals that version's tokens served alone
    model = tiny_model("llama")
    for k in (1, 2, 3):
        alone = make_engine(model, adapter_merge_mb=0)
        config, blob = _version(model, 10 + k)
        alone.load_adapter("pol", config=config, weights=blob)
        rids = [rid for rid in packed if rid.startswith(f"v{k}-")]
        prompts = {f"v1-{i}": [3 + i, 4, 5, 6] for i in range(3)} | \
            {f"v{j}-{i}": [20 + i, 21, 22, 23, 24][:3 + i] for j in (2, 3) for i in range(2)}
        out = run_all(alone, [req(rid=r, prompt_ids=prompts[r], params=greedy(len(packed[r]["tokens"])),
                                  adapter="pol") for r in rids])
        for r in rids:
            assert out[(r, 0)]["tokens"] == packed[r]["tokens"], r
