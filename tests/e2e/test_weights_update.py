"""A full-weight policy update on the real server while 16 streams run (slow: two servers of its own).

Every stream's tokens after the update's step boundary carry the new base-model version; greedy
output after the update equals a fresh server started on the new weights; a trainer's chunked
publish over the PUB socket (one layer per message) gives the same weights again, and one whose third
chunk is corrupt changes nothing and is reported in /v1/training/status."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from parallm.client import Client
from parallm.config import ModelConfig
from parallm.models import load_model
from parallm.adapters import save_bytes
from parallm.engine.weights import by_layer
from parallm.protocol import SamplingParams, WeightsUpdate
from parallm.training.publisher import AdapterPublisher

from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [[1, 504, 3458, 282, 2], [1, 9690, 30], [1, 422, 5248, 314, 253, 1694, 28], [1, 19, 2]]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    """The default model's directory with perturbed weights: (directory, tensors)."""
    loaded = load_model(ModelConfig(dtype="float32"))
    out = tmp_path_factory.mktemp("new-weights")
    for f in loaded.source.path.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    for key in ("quantization", "quantization_config"):  # the GGUF's quantized tensors are dequantized here
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(3)
    weights = {k: v * (1 + 0.05 * mx.random.normal(v.shape)) if ".layers." in k else v
               for k, v in tree_flatten(loaded.model.parameters())}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out, weights


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Server("--engine.max-num-seqs", "32", "--adapters.allowed-dirs", str(tmp_path_factory.getbasetemp())) as srv:
        yield srv


def greedy_all(client: Client, n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [r.token_ids for [r] in client.generate_group(PROMPTS, params)]


def test_update_while_16_streams_run_then_equal_to_a_fresh_server(server, new_weights):
    path, weights = new_weights
    results: list = []
    with Client(server.router, timeout=600) as client:
        before = greedy_all(client)

        def stream(i: int) -> None:
            with Client(server.router, timeout=600) as c:
                results.extend(c.generate(PROMPTS[i % 4], SamplingParams(temperature=1.0, seed=i, max_tokens=96,
                                                                         ignore_eos=True)))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while client.stats().running < 16:       # every stream admitted and decoding
            assert time.monotonic() < deadline, "the 16 streams never ran together"
            time.sleep(0.05)
        r = httpx.post(f"{server.url}/v1/weights", json={"path": str(path)}, timeout=600)
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        for t in threads:
            t.join()
        assert len(results) == 16
        for res in results:
            assert len(res.token_ids) == 96
            assert res.versions[0] == (0, 0) and res.versions[-1][1] == 1, res.versions   # switched mid-stream
            assert [v for _, v in res.versions] == sorted(v for _, v in res.versions)
        after = greedy_all(client)
        assert after != before
        assert client.stats().weights_version == 1
        assert httpx.get(f"{server.url}/v1/policy").json()["versions"][""] == 1

        # the same weights again, as a trainer publishes them: one layer per PUB message
        publisher = AdapterPublisher(client.welcome.addresses["adapters"])
        publisher.publish_weights(weights, version=5)
        deadline = time.monotonic() + 120
        while client.stats().weights_version < 5:
            assert time.monotonic() < deadline, "the chunked update never completed"
            time.sleep(0.05)
        assert greedy_all(client) == after

        # an update that fails midway (its third chunk corrupt) changes nothing, and the trainer is told why
        groups = by_layer({k: v * 0.5 for k, v in weights.items()})
        for i, group in enumerate(groups):
            blob = save_bytes(group)
            publisher.sender.send(WeightsUpdate(weights=blob[:64] if i == 2 else blob, update_id="broken", chunk=i,
                                                chunks=len(groups), version=6))
        deadline = time.monotonic() + 120
        while not (status := httpx.get(f"{server.url}/v1/training/status").json()["weights"])["rejected"]:
            assert time.monotonic() < deadline, "the broken update was never refused"
            time.sleep(0.05)
        publisher.close()
        assert status["last_error_code"] == "invalid_weights" and "'broken'" in status["last_error"], status
        assert status["version"] == 5 and greedy_all(client) == after

    with Server("--model.path", str(path)) as fresh, Client(fresh.router, timeout=600) as c:
        assert greedy_all(c) == after


def test_update_routes_of_prime_rl_and_sglang(server, new_weights):
    path, _ = new_weights
    r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(path)}, timeout=600)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(path), "weight_version": "100"},
                   timeout=600)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": "/no/such/dir"}, timeout=60)
    assert r.status_code == 400 and r.json()["success"] is False
    r = httpx.post(f"{server.url}/v1/weights", json={"path": "/no/such/dir"}, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "weights_path_not_allowed"  # outside the roots
    r = httpx.post(f"{server.url}/v1/weights", json={"path": str(path.parent / "no-such-dir")}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "weights_not_found"
