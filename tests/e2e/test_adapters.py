"""Adapters on the real server: a trainer's PUB publishes versions while raw-client streams run."""

from __future__ import annotations

import json
import time

import httpx
import mlx.core as mx
import pytest

from parallm.client import Client, ClientError
from parallm.protocol import SamplingParams
from parallm.training.publisher import AdapterPublisher

pytestmark = pytest.mark.e2e

PROMPTS = [[1, 504, 3458, 282, 2], [1, 9690, 30], [1, 422, 5248, 314, 253, 1694, 28], [1, 19, 2]]
LAYERS, HIDDEN, KV = 30, 576, 192  # SmolLM2-135M: q_proj 576 -> 576, v_proj 576 -> 192


def weights(seed: int, rank: int = 16) -> dict[str, mx.array]:
    mx.random.seed(seed)
    w = {}
    for layer in range(LAYERS):
        for proj, out in (("q_proj", HIDDEN), ("v_proj", KV)):
            w[f"model.layers.{layer}.self_attn.{proj}.lora_a"] = mx.random.normal((HIDDEN, rank)) * 0.04
            w[f"model.layers.{layer}.self_attn.{proj}.lora_b"] = mx.random.normal((rank, out)) * 0.04
    return w


CONFIG = {"fine_tune_type": "lora", "num_layers": LAYERS, "lora_parameters": {"rank": 16, "scale": 2.0, "dropout": 0.0}}


def wait_for(client: Client, name: str, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while client.policy().get(name, 0) < version:
        assert time.monotonic() < deadline, f"{name} version {version} never arrived"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.router, timeout=600) as c:
        yield c


def _run(client, publisher, name, versions, streams, max_tokens):
    """Publish `versions` while `streams` requests run; returns the results and when each version landed."""
    publisher.publish(name, 1, weights(1), CONFIG)
    wait_for(client, name, 1)
    rids = [client.submit(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                                                    ignore_eos=True), adapter=name)
            for i in range(streams)]
    for v in range(2, versions + 1):
        publisher.publish(name, v, weights(v), CONFIG)
        if v % 5 == 0:  # new streams keep arriving under the newest version
            rids.append(client.submit(PROMPTS[v % len(PROMPTS)], SamplingParams(max_tokens=8, temperature=0,
                                                                                ignore_eos=True), adapter=name))
    results = [client.result(rid)[0] for rid in rids]
    wait_for(client, name, versions)
    return results


def test_versions_published_while_streams_run(server, client):
    rejected = client.stats().adapters.rejected  # the session's server: other tests' bad versions count too
    publisher = AdapterPublisher(client.welcome.addresses["adapters"])
    try:
        results = _run(client, publisher, "e2e-pol", versions=10, streams=8, max_tokens=24)
    finally:
        publisher.close()
    for r in results:
        assert r.finish_reason == "length" and r.adapter == "e2e-pol"
        assert [v for _, v in r.versions] and all(1 <= v <= 10 for _, v in r.versions)
        assert len(r.versions) == 1  # a sequence keeps the version it started with
    assert max(r.versions[0][1] for r in results) > 1  # later requests got later versions
    stats = client.stats()
    assert stats.adapters.rejected == rejected and stats.adapters.versions_kept >= 1
    # a bad version is refused and serving continues
    publisher = AdapterPublisher(client.welcome.addresses["adapters"])
    bad = weights(99)
    bad["model.layers.0.self_attn.q_proj.lora_a"] = bad["model.layers.0.self_attn.q_proj.lora_a"] * float("nan")
    publisher.publish("e2e-pol", 11, bad, CONFIG)
    publisher.close()
    deadline = time.monotonic() + 30
    while client.stats().adapters.rejected < rejected + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.policy()["e2e-pol"] == 10
    [ok] = client.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0), adapter="e2e-pol")
    assert ok.versions == [(0, 10)]
    # operators see the served version on /metrics (ingress polls the engine's stats)
    deadline = time.monotonic() + 10
    while 'parallm_adapter_version{adapter="e2e-pol"} 10.0' not in httpx.get(f"{server.url}/metrics").text:
        assert time.monotonic() < deadline, "the adapter version never reached /metrics"
        time.sleep(0.2)


def test_unknown_adapter_is_404_and_min_version_409(client):
    with pytest.raises(ClientError) as info:
        client.generate(PROMPTS[0], SamplingParams(max_tokens=2), adapter="no-such-adapter")
    assert info.value.status == 404 and info.value.code == "adapter_not_found"
    with pytest.raises(ClientError) as info:
        client.generate(PROMPTS[0], SamplingParams(max_tokens=2), adapter="e2e-pol", min_version=1000)
    assert info.value.status == 409


@pytest.mark.slow
def test_fifty_versions_sixteen_streams(client):
    rejected = client.stats().adapters.rejected  # the session's server: other tests' bad versions count too
    publisher = AdapterPublisher(client.welcome.addresses["adapters"])
    try:
        results = _run(client, publisher, "e2e-fifty", versions=50, streams=16, max_tokens=64)
    finally:
        publisher.close()
    assert [(r.finish_reason, len(r.versions)) for r in results] == [("length", 1)] * len(results)
    assert client.stats().adapters.rejected == rejected


@pytest.mark.slow  # > 20 s on the 2-core CI host: make test's 10-minute budget
def test_hold_policy_waits_for_the_version():
    """With adapters.staleness_policy "hold", a request for a version not yet published waits for it."""
    import threading

    from .server import Server

    with Server("--adapters.staleness-policy", "hold", "--adapters.hold-timeout-s", "60") as srv, \
            Client(srv.router, timeout=120) as c:
        publisher = AdapterPublisher(c.welcome.addresses["adapters"])
        try:
            publisher.publish("held", 1, weights(1), CONFIG)
            wait_for(c, "held", 1)
            got: list = []

            def ask() -> None:
                with Client(srv.router, timeout=120) as other:
                    got.extend(other.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0),
                                              adapter="held", min_version=2))

            thread = threading.Thread(target=ask)
            thread.start()
            deadline = time.monotonic() + 30
            while c.stats().held_for_version < 1:
                assert time.monotonic() < deadline, "the request was not held"
                time.sleep(0.05)
            assert not got
            publisher.publish("held", 2, weights(2), CONFIG)
            thread.join(60)
            assert len(got) == 1 and got[0].versions == [(0, 2)] and got[0].finish_reason == "length"
            assert c.stats().held_for_version == 0
        finally:
            publisher.close()


def test_multipart_upload_then_openai_requests_use_it(server, client, openai_client):
    """The MLX RL Inference Server's multipart upload, then the adapter chosen per request over HTTP
    (model suffix or `adapter` field) gives the raw ZeroMQ client's tokens; a bad upload is a 400."""
    from parallm.adapters import save_bytes

    name = "e2e-upload"
    files = {"adapter_weights": ("adapters.safetensors", save_bytes(weights(7)), "application/octet-stream"),
             "adapter_config": ("adapter_config.json", json.dumps(CONFIG), "application/json")}
    r = httpx.post(f"{server.url}/v1/adapters/upload", files=files, data={"name": name}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == name and r.json()["version"] == 1
    base = openai_client.models.list().data[0].id
    [raw] = client.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), adapter=name,
                            detok=True)
    assert raw.versions == [(0, 1)] and len(raw.token_ids) == 8
    want = raw.text
    by_suffix = openai_client.completions.create(model=f"{base}:{name}", prompt=PROMPTS[0], max_tokens=8,
                                                 temperature=0, extra_body={"ignore_eos": True})
    by_field = openai_client.completions.create(model=base, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                extra_body={"adapter": name, "ignore_eos": True})
    plain = openai_client.completions.create(model=base, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert by_suffix.choices[0].text == by_field.choices[0].text == want
    assert plain.choices[0].text != want  # the adapter changes what the model says
    bad = weights(8)
    bad["model.layers.3.self_attn.v_proj.lora_b"] = bad["model.layers.3.self_attn.v_proj.lora_b"] * float("inf")
    files["adapter_weights"] = ("adapters.safetensors", save_bytes(bad), "application/octet-stream")
    r = httpx.post(f"{server.url}/upload_adapter", files=files, data={"name": name}, timeout=60)
    assert r.status_code == 400 and "model.layers.3.self_attn.v_proj.lora_b" in r.json()["error"]["message"]
    listing = httpx.get(f"{server.url}/v1/adapters", timeout=30).json()
    [entry] = [a for a in listing["data"] if a["id"] == name]
    assert entry["latest_version"] == 1 and entry["versions"][0]["merged"] is False  # CPU: factored
    again = openai_client.completions.create(model=f"{base}:{name}", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert again.choices[0].text == want


def test_load_adapter_makes_it_the_policy_of_the_next_generate(server, client, tmp_path):
    """An MLX RL Inference Server client: /upload_adapter, then /generate naming no adapter, is served
    by the adapter it just loaded (the default policy), and greedy output differs from the base."""
    from parallm.adapters import save_bytes

    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True}
    base = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
    files = {"adapter_weights": ("adapters.safetensors", save_bytes(weights(41)), "application/octet-stream"),
             "adapter_config": ("adapter_config.json", json.dumps(CONFIG), "application/json")}
    try:
        r = httpx.post(f"{server.url}/upload_adapter", files=files, timeout=120)
        assert r.status_code == 200, r.text
        version = r.json()["policy_version"]
        assert httpx.get(f"{server.url}/v1/policy").json()["default_adapter"] == "default"
        tuned = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        assert tuned["versions"] == [[0, version]]
        assert tuned["completion_ids"] != base["completion_ids"]
        explicit = client.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                   adapter="default")[0]
        assert explicit.token_ids == tuned["completion_ids"]
    finally:
        httpx.delete(f"{server.url}/v1/adapters/default", timeout=60)
    assert httpx.get(f"{server.url}/v1/policy").json()["default_adapter"] == ""
    again = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
    assert again["completion_ids"] == base["completion_ids"] and again["versions"] == [[0, 0]]


def test_adapter_version_pinned_over_http_and_max_staleness_applies(server, client):
    publisher = AdapterPublisher(client.welcome.addresses["adapters"])
    try:
        for v in (1, 2, 3):
            publisher.publish("e2e-pin", v, weights(50 + v), CONFIG)
        wait_for(client, "e2e-pin", 3)
    finally:
        publisher.close()
    body = {"model": client.model, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "adapter": "e2e-pin",
            "logprobs": 0}
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "adapter_version": 2}, timeout=120)
    assert r.status_code == 200, r.text
    gen = httpx.post(f"{server.url}/generate", json={"prompt": [1, 2, 3], "max_tokens": 3, "adapter": "e2e-pin",
                                                     "adapter_version": 2}, timeout=120).json()
    assert gen["versions"] == [[0, 2]]
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "adapter_version": 1, "max_staleness": 1}, timeout=120)
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_unavailable", r.text
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "adapter_version": 2, "max_staleness": 1}, timeout=120)
    assert r.status_code == 200, r.text
    httpx.delete(f"{server.url}/v1/adapters/e2e-pin", timeout=60)
