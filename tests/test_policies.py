"""parallm.policies: the model format, exact forwards, seeded sampling, log-probs and recurrent state."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from parallm.policies import Policy, PolicyLoadError, TensorError, parse_spec, save_policy
from parallm.policies.rng import row_seeds, uniforms
from parallm.policies.tensors import from_buffer, from_json, to_buffer, to_json

from tests._policy_helpers import MLP_CATEGORICAL, chi2_critical, make_policies


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Policy]:
    dirs = make_policies(tmp_path_factory.mktemp("policies"))
    return {name: Policy.load(name, d) for name, d in dirs.items()}


def _weights(policy: Policy) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten
    return {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(policy.net.parameters())}


def _mlp_logits(policy: Policy, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The MLP categorical policy computed in numpy from its weights: (logits, value)."""
    w = _weights(policy)
    x = obs.astype(np.float64)
    for i in range(2):
        x = np.tanh(x @ w[f"blocks.0.layers.{i}.weight"].T + w[f"blocks.0.layers.{i}.bias"])
    return x @ w["heads.logits.weight"].T + w["heads.logits.bias"], (x @ w["heads.value.weight"].T + w["heads.value.bias"])[:, 0]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_mlp_categorical_deterministic_equals_a_direct_forward(policies):
    p = policies["mlp"]
    obs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    res = p.act({"obs": obs}, {}, row_seeds(1, 64), np.ones(64, bool))
    logits, value = _mlp_logits(p, obs)
    assert (res.actions == logits.argmax(-1)).all()
    np.testing.assert_allclose(res.value_estimates, value, rtol=1e-5, atol=1e-6)
    direct, _ = p.net({"obs": mx.array(obs)}, {})
    exact = _log_softmax(np.array(direct["logits"], dtype=np.float64))[np.arange(64), res.actions].astype(np.float32)
    assert (res.action_log_probs == exact).all()     # log-probs are those of the forward's logits, exactly


def test_categorical_samples_match_the_distribution(policies):
    p = policies["mlp"]
    n = 30000
    obs = np.tile(np.array([[0.3, -1.0, 0.5, 2.0]], np.float32), (n, 1))
    res = p.act({"obs": obs}, {}, row_seeds(1234, n), np.zeros(n, bool))
    probs = np.exp(_log_softmax(_mlp_logits(p, obs[:1])[0][0]))
    counts = np.bincount(res.actions, minlength=3)
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum()
    assert chi2 < chi2_critical(2), (counts, probs)
    exact = _log_softmax(np.array(p.net({"obs": mx.array(obs[:1])}, {})[0]["logits"], np.float64))[0]
    assert (res.action_log_probs == exact[res.actions].astype(np.float32)).all()


def test_gaussian_samples_and_log_probs(policies):
    p = policies["gauss"]
    n = 20000
    obs = np.tile(np.array([[0.1, 0.2, -0.3]], np.float32), (n, 1))
    det = p.act({"obs": obs[:1]}, {}, row_seeds(0, 1), np.ones(1, bool))
    res = p.act({"obs": obs}, {}, row_seeds(99, n), np.zeros(n, bool))
    outs, _ = p.forward({"obs": obs[:1]}, {})
    mean, log_std = outs["mean"][0].astype(np.float64), outs["log_std"][0].astype(np.float64)
    assert (det.actions[0] == outs["mean"][0]).all()
    np.testing.assert_allclose(log_std, -0.5)
    z = (res.actions.astype(np.float64) - mean) / np.exp(log_std)
    edges = np.array([-np.inf, -1.5, -0.75, -0.25, 0.25, 0.75, 1.5, np.inf])
    cdf = np.array([0.5 * (1 + math.erf(e / math.sqrt(2))) if np.isfinite(e) else float(e > 0) for e in edges])
    expected = n * np.diff(cdf)
    for d in range(2):
        counts = np.histogram(z[:, d], edges)[0]
        assert (((counts - expected) ** 2) / expected).sum() < chi2_critical(len(expected) - 1)
    want = (-0.5 * z ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
    np.testing.assert_allclose(res.action_log_probs, want, rtol=1e-6)
    assert res.value_estimates.shape == (n,)


def test_a_rows_draw_depends_only_on_its_seed(policies):
    p = policies["mlp"]
    obs = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    seeds = row_seeds(7, 8)
    batched = p.act({"obs": obs}, {}, seeds, np.zeros(8, bool)).actions
    alone = [p.act({"obs": obs[i:i + 1]}, {}, seeds[i:i + 1], np.zeros(1, bool)).actions[0] for i in range(8)]
    assert batched.tolist() == alone
    assert (p.act({"obs": obs}, {}, seeds, np.zeros(8, bool)).actions == batched).all()


def test_uniforms_are_uniform_and_reproducible():
    u = uniforms(row_seeds(5, 1000), 50)
    assert u.shape == (1000, 50) and (u > 0).all() and (u < 1).all()
    counts = np.histogram(u, 20, (0, 1))[0]
    assert (((counts - u.size / 20) ** 2) / (u.size / 20)).sum() < chi2_critical(19)
    assert (uniforms(row_seeds(5, 1000), 50) == u).all()


def test_lstm_state_steps_equal_the_whole_sequence(policies):
    p = policies["lstm"]
    steps = np.random.default_rng(2).normal(size=(6, 5, 4)).astype(np.float32)   # [T, B, obs]
    state = p.signature.zero_state(5)
    for t in range(6):
        res = p.act({"obs": steps[t]}, state, row_seeds(t, 5), np.ones(5, bool))
        state = res.new_state
    # the direct forward: the MLP on every step, then mlx's LSTM over the whole sequence at once
    x = p.net.blocks[0](mx.array(steps.transpose(1, 0, 2).reshape(30, 4))).reshape(5, 6, -1)
    hs, cs = p.net.blocks[1].cell(x)
    np.testing.assert_allclose(state["h"], np.array(hs[:, -1]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["c"], np.array(cs[:, -1]), rtol=1e-5, atol=1e-6)
    logits = np.array(p.net.heads["logits"](hs[:, -1]), np.float64)
    assert (res.actions == logits.argmax(-1)).all()
    assert (res.action_log_probs == _log_softmax(logits)[np.arange(5), res.actions].astype(np.float32)).all()
    assert set(p.signature.state) == {"h", "c"}


def test_predict_outputs_and_signature(policies):
    p = policies["reg"]
    sig = p.signature
    assert sig.to_json()["outputs"] == {"y": {"shape": [None, 3], "dtype": "float32"}}
    inputs, rows = sig.check_inputs({"x": np.ones((2, 2)), "k": np.array([1, 2])})
    assert rows == 2 and inputs["k"].dtype == np.int32 and inputs["x"].dtype == np.float32
    outs, state = p.forward(inputs, {})
    assert outs["y"].shape == (2, 3) and state == {}
    with pytest.raises(ValueError, match="no action head"):
        p.act(inputs, {}, row_seeds(0, 2), np.zeros(2, bool))


@pytest.mark.parametrize("tensors, name, why", [
    ({"x": np.ones((2, 2))}, "k", "missing"),
    ({"x": np.ones((2, 3)), "k": np.ones(2, np.int64)}, "x", "shape"),
    ({"x": np.ones((2, 2)), "k": np.ones(3, np.int64)}, "k", "rows"),
    ({"x": np.ones((2, 2)), "k": np.array([0.5, 1.0])}, "k", "dtype"),
    ({"x": np.array([[1.0, np.nan], [0, 0]]), "k": np.ones(2, np.int64)}, "x", "NaN"),
    ({"x": np.ones((2, 2)), "k": np.ones(2, np.int64), "z": np.ones(2)}, "z", "not an input"),
])
def test_bad_tensors_name_the_tensor(policies, tensors, name, why):
    with pytest.raises(TensorError, match=why) as e:
        policies["reg"].signature.check_inputs(tensors)
    assert e.value.tensor == name and f"'{name}'" in str(e.value)


def test_state_must_be_whole(policies):
    sig = policies["lstm"].signature
    with pytest.raises(TensorError, match="'c'"):
        sig.check_state({"h": np.zeros((1, 8))}, 1)
    with pytest.raises(TensorError, match="'h'"):
        sig.check_state({"h": np.zeros((2, 8)), "c": np.zeros((2, 8))}, 1)


def test_tensor_wire_forms():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert (from_json("t", to_json(a, b64=True)) == a).all()
    assert from_json("t", to_json(a, b64=False)).tolist() == a.tolist()
    dtype, shape, data = to_buffer(a)
    assert (from_buffer("t", dtype, shape, data) == a).all() and data == a.astype("<f4").tobytes()
    with pytest.raises(TensorError, match="'t'.*bytes"):
        from_buffer("t", "float32", [3, 5], data)
    with pytest.raises(TensorError, match="'t'.*dtype"):
        from_buffer("t", "complex64", [3, 4], data)
    with pytest.raises(TensorError, match="'t'.*ragged"):
        from_json("t", [[1, 2], [3]])
    with pytest.raises(TensorError, match="'t'.*base64"):
        from_json("t", {"b64": "@@", "dtype": "float32", "shape": [1]})
    with pytest.raises(TensorError, match="'t'.*numbers"):
        from_json("t", [["a"]])


def test_weight_updates_are_whole_and_versioned(tmp_path, policies):
    src = Policy.load("a", save_policy(tmp_path / "a", MLP_CATEGORICAL, seed=11))
    dst = Policy.load("b", save_policy(tmp_path / "b", MLP_CATEGORICAL, seed=12))
    obs = {"obs": np.ones((1, 4), np.float32)}
    assert not np.array_equal(src.forward(obs, {})[0]["logits"], dst.forward(obs, {})[0]["logits"])
    dst.set_weights(src.weights_bytes(), 3)
    assert dst.version == 3 and np.array_equal(src.forward(obs, {})[0]["logits"], dst.forward(obs, {})[0]["logits"])
    with pytest.raises(PolicyLoadError, match="missing"):
        dst.set_weights(policies["gauss"].weights_bytes(), 4)
    assert dst.version == 3


def test_user_module_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_nets.py").write_text(textwrap.dedent("""
        import mlx.core as mx
        import mlx.nn as nn

        class Net(nn.Module):
            def __init__(self, hidden):
                super().__init__()
                self.l1 = nn.Linear(2, hidden)
                self.out = nn.Linear(hidden, 4)

            def __call__(self, inputs, state):
                h = mx.tanh(self.l1(inputs["x"]) + state["h"])
                return {"logits": self.out(h)}, {"h": h}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"format": "parallm-policy/1", "inputs": {"x": {"shape": [None, 2]}},
            "module": {"path": "my_nets:Net", "args": {"hidden": 5},
                       "outputs": {"logits": {"shape": [None, 4]}}, "state": {"h": {"shape": [None, 5]}}},
            "action": {"type": "categorical", "n": 4}}
    p = Policy.load("u", save_policy(tmp_path / "u", spec))
    res = p.act({"x": np.ones((3, 2), np.float32)}, p.signature.zero_state(3), row_seeds(0, 3), np.ones(3, bool))
    assert res.actions.shape == (3,) and res.new_state["h"].shape == (3, 5) and res.value_estimates is None
    sys.modules.pop("my_nets", None)


@pytest.mark.parametrize("change, why", [
    ({"format": "other"}, "format"),
    ({"network": {"blocks": [{"type": "transformer"}]}}, "not a known block"),
    ({"network": {"blocks": [{"type": "mlp", "sizes": [4]}, {"type": "conv", "channels": [2]}]}}, "first block"),
    ({"action": {"type": "beta"}}, "categorical"),
    ({"inputs": {"obs": {"shape": [4]}}}, "batch"),
    ({"inputs": {"obs": {"shape": [None, 4], "dtype": "complex64"}}}, "dtype"),
    ({"module": {"path": "x:y"}}, "exactly one"),
    ({"extra": 1}, "unknown keys"),
])
def test_bad_specs_are_refused(change, why):
    with pytest.raises(PolicyLoadError, match=why):
        parse_spec({**MLP_CATEGORICAL, **change})


def test_conv_gru_policy_loads_and_acts(tmp_path):
    spec = {"format": "parallm-policy/1",
            "inputs": {"img": {"shape": [None, 8, 8, 3], "dtype": "uint8"}, "v": {"shape": [None, 2]}},
            "network": {"blocks": [{"type": "conv", "channels": [4, 4], "strides": [2, 1]}, {"type": "gru", "hidden": 5}]},
            "action": {"type": "gaussian", "dim": 2, "log_std": "output"}, "value": True}
    p = Policy.load("c", save_policy(tmp_path / "c", spec))
    inputs, rows = p.signature.check_inputs({"img": np.zeros((3, 8, 8, 3), np.int64), "v": np.ones((3, 2))})
    assert inputs["img"].dtype == np.uint8
    res = p.act(inputs, p.signature.zero_state(rows), row_seeds(0, 3), np.zeros(3, bool))
    assert res.actions.shape == (3, 2) and res.new_state["h"].shape == (3, 5)
    assert json.loads((tmp_path / "c" / "policy.json").read_text()) == spec
