"""End to end: non-LLM policies served by parallm-launch with only --policy-model (no language model),
over the raw ZeroMQ client and HTTP: outputs equal a direct forward, sampled frequencies match the
distribution, bad tensors get a 400 naming them, and a CartPole loop (written here) keeps acting while
a trainer's weight update lands."""

from __future__ import annotations

import base64
import math
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import zmq

from parallm import protocol
from parallm.policies import Policy, save_policy
from parallm.policies.client import PolicyClient
from parallm.policies.distributions import log_softmax
from parallm.policies.rng import row_seeds
from parallm.training.publisher import AdapterPublisher
from tests._policy_helpers import LSTM_CATEGORICAL, chi2_critical, make_policies

from .server import Server


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_policies(tmp_path_factory.mktemp("served-policies"))


@pytest.fixture(scope="module")
def direct(dirs):
    return {name: Policy.load(name, d) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def policy_server(dirs):
    args = [a for name, d in dirs.items() for a in ("--policy-model", f"{name}={d}")]
    with Server(*args, "--policies.flush-us", "500") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(policy_server):
    with PolicyClient(policy_server.policy, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(policy_server):
    with httpx.Client(base_url=policy_server.url, timeout=60) as c:
        yield c


class CartPole:
    """The classic cart-pole (Barto, Sutton and Anderson 1983), as Gym writes it: Euler steps of 20 ms."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self) -> np.ndarray:
        self.state = self.rng.uniform(-0.05, 0.05, 4)
        self.steps = 0
        return self.state.astype(np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        self.state = np.array([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
                               theta_dot + 0.02 * theta_acc])
        self.steps += 1
        done = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 0.2095 or self.steps >= 200
        return self.state.astype(np.float32), 1.0, done


def test_cartpole_loop_over_the_raw_client_while_weights_land(policy_server, client, tmp_path):
    envs = [CartPole(seed) for seed in range(16)]
    obs = np.stack([env.reset() for env in envs])
    episode = [0] * 16
    starts = [True] * 16
    new = Policy.load("new", save_policy(tmp_path / "new", LSTM_CATEGORICAL, seed=99))
    publisher = AdapterPublisher(policy_server.policy_weights)
    versions, finished, returns = [], 0, np.zeros(16)
    try:
        for step in range(400):
            out = client.act("lstm", obs, episode_ids=[f"env{i}-{episode[i]}" for i in range(16)],
                             episode_starts=starts, seed=step)
            assert out.actions.shape == (16,) and set(out.actions.tolist()) <= {0, 1}
            assert (out.action_log_probs <= 0).all() and out.value_estimates.shape == (16,)
            versions.append(out.version)
            if step == 50:
                publisher.publish_policy("lstm", new.weights_bytes(), version=7)
            if step > 60 and out.version == 7 and step >= 150:
                break
            starts = [False] * 16
            for i, env in enumerate(envs):
                obs[i], reward, done = env.step(int(out.actions[i]))
                returns[i] += reward
                if done:
                    finished += 1
                    obs[i], episode[i], starts[i] = env.reset(), episode[i] + 1, True
    finally:
        publisher.close()
    assert versions[0] == 0 and versions[-1] == 7 and versions == sorted(versions), versions
    assert 0 in versions[:50] and finished > 0 and returns.sum() > 0
    # the new weights serve exactly: a deterministic step from zero state equals the direct forward
    state = new.signature.zero_state(16)
    served = client.act("lstm", obs, hidden_states=state, deterministic=True)
    want = new.act({"obs": obs}, state, row_seeds(0, 16), np.ones(16, bool))
    assert (served.actions == want.actions).all() and (served.action_log_probs == want.action_log_probs).all()
    assert all((served.new_hidden_states[k] == want.new_state[k]).all() for k in want.new_state)
    assert client.stats().versions["lstm"] == 7


def test_served_outputs_equal_a_direct_forward(client, direct):
    obs = np.random.default_rng(5).normal(size=(32, 4)).astype(np.float32)
    out = client.act("mlp", obs, deterministic=True)
    want = direct["mlp"].act({"obs": obs}, {}, row_seeds(0, 32), np.ones(32, bool))
    assert (out.actions == want.actions).all() and (out.action_log_probs == want.action_log_probs).all()
    assert (out.value_estimates == want.value_estimates).all()
    g_obs = obs[:, :3]
    g = client.act("gauss", g_obs, deterministic=True)
    outs, _ = direct["gauss"].forward({"obs": g_obs}, {})
    assert (g.actions == outs["mean"]).all()
    z = np.zeros_like(outs["mean"], dtype=np.float64)
    want_lp = (-0.5 * z ** 2 - outs["log_std"].astype(np.float64) - 0.5 * math.log(2 * math.pi)).sum(-1)
    np.testing.assert_allclose(g.action_log_probs, want_lp, rtol=1e-6)
    p = client.predict("reg", {"x": obs[:, :2], "k": np.arange(32, dtype=np.int32)})
    assert (p.outputs["y"] == direct["reg"].forward({"x": obs[:, :2], "k": np.arange(32, dtype=np.int32)}, {})[0]["y"]).all()


def test_served_samples_match_the_distribution(client, direct):
    n = 20000
    obs = np.tile(np.array([[0.5, -0.2, 0.1, 1.0]], np.float32), (n, 1))
    out = client.act("mlp", obs, seed=2024)
    logits = direct["mlp"].forward({"obs": obs[:1]}, {})[0]["logits"][0]
    logp = log_softmax(logits[None])[0]
    counts = np.bincount(out.actions, minlength=3)
    assert (((counts - n * np.exp(logp)) ** 2) / (n * np.exp(logp))).sum() < chi2_critical(2), counts
    assert (out.action_log_probs == logp[out.actions].astype(np.float32)).all()
    again = client.act("mlp", obs[:100], seed=2024)
    assert (again.actions == out.actions[:100]).all()     # a row's draw depends on its seed only


def test_http_act_json_and_base64(http, direct):
    obs = np.random.default_rng(6).normal(size=(3, 4)).astype(np.float32)
    body = {"model": "lstm", "observations": obs.tolist(), "deterministic": True}
    js = http.post("/v1/rl/act", json=body)
    assert js.status_code == 200, js.text
    b64 = {"b64": base64.b64encode(obs.astype("<f4").tobytes()).decode(), "dtype": "float32", "shape": [3, 4]}
    bs = http.post("/v1/rl/act", json={**body, "observations": {"obs": b64}, "encoding": "base64"}).json()
    actions = np.frombuffer(base64.b64decode(bs["actions"]["b64"]), "<i8")
    assert js.json()["actions"] == actions.tolist() and bs["version"] == js.json()["version"]
    h = np.frombuffer(base64.b64decode(bs["new_hidden_states"]["h"]["b64"]), "<f4").reshape(3, 8)
    np.testing.assert_array_equal(h, np.array(js.json()["new_hidden_states"]["h"], np.float32))
    pred = http.post("/v1/predict", json={"model": "reg", "inputs": {"x": [[1, 2]], "k": [3]}}).json()
    assert len(pred["outputs"]["y"][0]) == 3
    listed = {p["name"]: p for p in http.get("/v1/policies").json()["data"]}
    assert listed["lstm"]["signature"]["state"]["h"]["shape"] == [None, 8] and listed["gauss"]["action"] == "gaussian"


@pytest.mark.parametrize("body, param, words", [
    ({"model": "mlp", "observations": [[1, 2, 3]]}, "obs", "shape"),
    ({"model": "reg", "inputs": {"x": [[1, 2]]}}, "k", "missing"),
    ({"model": "reg", "inputs": {"x": [[1, 2]], "k": [0.5]}}, "k", "dtype"),
    ({"model": "mlp", "observations": {"b64": base64.b64encode(np.array([[np.nan] * 4], "<f4").tobytes()).decode(),
                                       "dtype": "float32", "shape": [1, 4]}}, "obs", "NaN"),
    ({"model": "mlp", "observations": [[1, 2], [3]]}, "observations", "ragged"),
    ({"model": "lstm", "observations": [[1, 2, 3, 4]], "hidden_states": {"h": [[0] * 8]}}, "c", "missing"),
    ({"model": "nope", "observations": [[1, 2, 3, 4]]}, "model", "no policy"),
])
def test_bad_tensors_get_a_400_naming_them(http, body, param, words):
    route = "/v1/predict" if "inputs" in body else "/v1/rl/act"
    r = http.post(route, json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_no_language_model_routes_and_health(http):
    assert http.post("/v1/chat/completions", json={"model": "x", "messages": []}).status_code == 404
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/readyz").status_code == 200


def test_a_malformed_raw_frame_is_answered(policy_server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(policy_server.policy)
    try:
        sock.send(protocol.encode(protocol.ListPolicies(qid="q1")).replace(b"q1", b"q2"))  # fine: a valid frame
        frame = msgspec_frame({"type": "policy_act", "v": protocol.PROTOCOL_VERSION, "qid": "bad", "model": 5,
                               "inputs": {}})
        sock.send(frame)
        replies = {}
        while len(replies) < 2 and sock.poll(10000):
            reply = protocol.decode(sock.recv(), protocol.PolicyClientInbound)
            replies[getattr(reply, "qid", getattr(reply, "rid", ""))] = reply
        assert isinstance(replies["q2"], protocol.PolicyList)
        assert isinstance(replies["bad"], protocol.RequestError) and replies["bad"].status == 400
    finally:
        sock.close(0)
        ctx.term()


def msgspec_frame(obj: dict) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(obj)


def test_policies_beside_the_language_model(server):
    """The session server serves the default model and a policy: both answer, and the raw client's
    Welcome names the policy stage's addresses."""
    from parallm.client import Client

    with httpx.Client(base_url=server.url, timeout=60) as session:
        act = session.post("/v1/rl/act", json={"model": "mlp", "observations": [[0, 0, 0, 0]], "deterministic": True})
        assert act.status_code == 200 and act.json()["version"] == 0
        assert session.get("/v1/models").status_code == 200
    with Client(server.router, timeout=60) as raw:
        assert raw.welcome.addresses["policy"] == server.policy
    with PolicyClient(server.policy) as c:
        assert [p.name for p in c.policies()] == ["mlp"]


def test_metrics_show_the_policy_stage(http, client):
    client.act("mlp", np.zeros((2, 4), np.float32))
    deadline = time.monotonic() + 10
    while True:  # ingress polls the policy stage's stats every 0.5 s
        text = http.get("/metrics").text
        if "parallm_policy_rows_total" in text or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert "parallm_policy_rows_total" in text and 'parallm_policy_version{model="lstm"}' in text
    assert "parallm_policy_request_seconds_count" in text


def test_a_dead_policy_stage_fails_what_it_held_and_comes_back(policy_server, http):
    """Run last in this module (it restarts the stage): a request held by a policy stage that dies ends at
    once with a retryable 503, and the restarted stage serves again (the weights from its directory)."""
    pid = policy_server.stage_pids()["policy"]
    os.kill(pid, signal.SIGSTOP)           # the request below waits in the frozen stage ...
    answer: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: answer.setdefault("r", http.post(
        "/v1/rl/act", json={"model": "mlp", "observations": [[0, 0, 0, 0]]})))
    thread.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)           # ... and ends when the supervisor announces the death
    thread.join(30)
    assert answer["r"].status_code == 503 and answer["r"].headers.get("retry-after") == "1", answer["r"].text
    policy_server.wait_restarted("policy", pid)
    r = http.post("/v1/rl/act", json={"model": "lstm", "observations": [[0, 0, 0, 0]]})
    assert r.status_code == 200 and r.json()["version"] == 0
