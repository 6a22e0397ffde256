"""Full-weight policy updates in the engine (parallm/engine/weights.py): applied at a step boundary,
greedy output afterwards equal to a model built on the new weights, the prefix cache not hit across
weights, per-token versions of running sequences, and bad updates changing nothing."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from _engine_helpers import greedy, reference_greedy, req, run_all, tiny_model
from parallm.config import Config, EngineConfig
from parallm.engine import Engine, EngineModel
from parallm.engine.weights import WeightsError, by_layer, layer_of

PROMPT = list(range(5, 30))  # longer than a prefix-cache block


def engine_on(model) -> Engine:
    return Engine(EngineModel(model, [0], 256, 101), Config(engine=EngineConfig(block_size=8, kv_budget_mb=16)))


def params(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def tokens(out: dict, rid: str) -> list[int]:
    return out[(rid, 0)]["tokens"]


def test_tensors_update_gives_the_new_models_greedy_output_and_no_stale_prefix_hit():
    old, new = tiny_model("llama", 0), tiny_model("llama", 1)
    want_old, want_new = reference_greedy(old, PROMPT, 6), reference_greedy(new, PROMPT, 6)
    assert want_old != want_new
    e = engine_on(old)
    assert tokens(run_all(e, [req("a", PROMPT, greedy(6))]), "a") == want_old
    applied = e.update_weights(tensors=params(new))
    assert applied.tensors == len(params(new)) and applied.layers == 3   # 2 layers + the rest
    out = run_all(e, [req("b", PROMPT, greedy(6))])
    assert tokens(out, "b") == want_new and out[("b", 0)]["usage"].cached_tokens == 0
    assert e.weights_version == 1 and e.stats().weights_version == 1 and e.stats().weights_updates == 1
    again = run_all(e, [req("c", PROMPT, greedy(6))])
    assert tokens(again, "c") == want_new and again[("c", 0)]["usage"].cached_tokens > 0  # new-weights blocks hit


def test_directory_update_with_hugging_face_names(tmp_path):
    old, new = tiny_model("qwen2", 0), tiny_model("qwen2", 2)
    weights = params(new)
    half = len(weights) // 2
    names = sorted(weights)
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"), {k: weights[k] for k in names[:half]})
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"), {k: weights[k] for k in names[half:]})
    e = engine_on(old)
    e.update_weights(path=str(tmp_path), version=7)
    assert tokens(run_all(e, [req("a", PROMPT, greedy(5))]), "a") == reference_greedy(new, PROMPT, 5)
    assert e.weights_version == 7
    with pytest.raises(WeightsError) as info:
        e.update_weights(path=str(tmp_path), version=7)
    assert info.value.status == 409


@pytest.mark.parametrize("bad, code", [
    (lambda w, k: {**w, k: w[k] * float("nan")}, "non_finite"),
    (lambda w, k: {**w, k: w[k][:1]}, "shape_mismatch"),
    (lambda w, k: {**w, "model.no_such.weight": w[k]}, "unknown_tensor"),
])
def test_a_bad_update_changes_nothing(bad, code, tmp_path):
    old, new = tiny_model("llama", 0), tiny_model("llama", 1)
    before = {k: mx.array(v) for k, v in params(old).items()}
    weights = params(new)
    last_layer = max(k for k in weights if layer_of(k) == 1)   # the last group applied
    e = engine_on(old)
    with pytest.raises(WeightsError) as info:
        e.update_weights(tensors=bad(weights, last_layer))
    assert info.value.code == code
    assert all(mx.array_equal(before[k], v).item() for k, v in params(old).items())
    mx.save_safetensors(str(tmp_path / "model.safetensors"), bad(weights, last_layer))
    with pytest.raises(WeightsError):
        e.update_weights(path=str(tmp_path))
    assert all(mx.array_equal(before[k], v).item() for k, v in params(old).items()) and e.weights_version == 0
    with pytest.raises(WeightsError) as missing:
        e.update_weights(path=str(tmp_path / "nope"))
    assert missing.value.status == 404


def test_running_sequences_carry_the_new_version_after_the_boundary():
    old, new = tiny_model("llama", 0), tiny_model("llama", 1)
    e = engine_on(old)
    for i in range(16):
        e.add_request(req(f"r{i}", PROMPT[i % 5:], greedy(12)))
    seen: dict[str, list[tuple[int, int]]] = {}   # rid -> (token count so far, version) per output

    def collect(outs):
        for o in outs:
            if o.token_ids:
                seen.setdefault(o.rid, []).append((len(o.token_ids), o.version))

    for _ in range(4):
        collect(e.step())
    e.update_weights(tensors=params(new))
    boundary = {rid: len(v) for rid, v in seen.items()}
    while e.has_work():
        collect(e.step())
    assert len(seen) == 16
    for rid, outs in seen.items():
        assert all(v == 0 for _, v in outs[:boundary.get(rid, 0)])
        after = outs[boundary.get(rid, 0):]
        # a pass launched before the boundary may still be read after it, under the old version
        assert after and after[-1][1] == 1 and [v for _, v in after] == sorted(v for _, v in after)


def test_by_layer_groups_one_layer_per_chunk():
    groups = by_layer({"model.layers.1.a": mx.zeros(1), "model.embed_tokens.weight": mx.zeros(1),
                       "model.layers.0.b": mx.zeros(1), "model.layers.1.c": mx.zeros(1)})
    assert [sorted(g) for g in groups] == [["model.embed_tokens.weight"], ["model.layers.0.b"],
                                           ["model.layers.1.a", "model.layers.1.c"]]


def test_a_fifo_in_the_weight_directory_is_refused_without_blocking(tmp_path):
    """Issue 30: a *.safetensors that is a FIFO blocked mx.load, and so the engine's step loop (the GIL
    held in open(2)), until the supervisor restarted the engine. It is refused at once now. In a child
    process: the old code hung the whole interpreter."""
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "model.safetensors")
    script = f"""
import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_weights_update import engine_on, tiny_model, WeightsError
e = engine_on(tiny_model("llama", 0))
try:
    e.update_weights(path={str(tmp_path)!r})
except WeightsError as exc:
    print(exc.status, exc.code, exc.message, e.weights_version)
"""
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("update_weights blocked on a FIFO")
    assert done.stdout.startswith("400 invalid_weights model.safetensors is not a regular file 0"), done.stderr
