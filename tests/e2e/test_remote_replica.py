"""End to end: an engine replica started elsewhere (python -m parallm.launch.remote, a second process
tree on this machine) serving a parallm server over tcp:// with CURVE keys (engine.remote_replicas):
requests are spread over the local and the remote replica, adapter versions reach it, its stats
reach replica 0, and when it dies the supervisor announces it down and the local replica serves
every request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from parallm import keys
from parallm.launch.local import free_port_range

from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def chat(url: str, text: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0})


def wait_for(predicate, what: str, timeout: float = 120.0, output=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:g} s\n{output()}")
        time.sleep(0.2)


def test_a_remote_engine_replica_over_tcp(tmp_path):
    from parallm.client import Client

    key_dir = tmp_path / "keys"
    keys.main(["new", str(key_dir), "server"])
    keys.main(["new", str(key_dir), "remote"])  # the remote engine's own pair: allowed by the server
    base = free_port_range(14)
    remote_port = free_port_range(2)
    common = ["--model.served-name", "m", "--transport.kind", "tcp", "--transport.tcp-base-port", str(base),
              "--transport.curve-server-key", str(key_dir / "server.key_secret"),
              "--transport.curve-clients", str(key_dir), "--engine.remote-replicas", f"tcp://127.0.0.1:{remote_port}"]
    with Server(*common) as server:  # a remote replica silent for supervisor.dead_after_s (10 s) is down
        remote = subprocess.Popen([sys.executable, "-m", "parallm.launch.remote", "--replica", "1", *common,
                                   "--engine.remote-client-key", str(key_dir / "remote.key_secret")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            wait_for(lambda: "remote engine replica 1 serves" in server.output(), "the remote replica never served",
                     output=server.output)
            client = Client(f"tcp://127.0.0.1:{base + 2}", timeout=60, server_key=str(key_dir / "server.key"),
                            client_key=str(key_dir / "remote.key_secret"))
            # the supervisor logs "serves", then announces it (StageUp); until the tokenizer has heard that,
            # it routes everything to replica 0 (on a quiet machine the requests below came first: [6, 0])
            wait_for(lambda: client.stats("tokenizer").down == [], "the tokenizer never took the remote replica up",
                     output=server.output)
            with ThreadPoolExecutor(6) as pool:
                replies = list(pool.map(lambda i: chat(server.url, f"Question {i}: what is {i} plus {i * 7}?"),
                                        range(6)))
            assert all(r.status_code == 200 for r in replies), ([r.text for r in replies], server.output())
            routed = client.stats("tokenizer").routed
            assert len(routed) == 2 and min(routed) >= 2, routed

            config, tensors = tiny_lora()
            client.load_adapter("remote-lora", 1, tensors, config)
            wait_for(lambda: [r.adapters.latest.get("remote-lora") for r in client.stats().replicas] == [1],
                     "the adapter version never reached the remote replica", timeout=30)

            os.killpg(remote.pid, signal.SIGKILL)  # the remote machine goes away
            wait_for(lambda: "remote engine replica 1 silent" in server.output(), "the remote replica was never "
                     "announced down", timeout=30, output=server.output)
            time.sleep(0.5)  # the tokenizers hear StageDown
            before = client.stats("tokenizer").routed
            for i in range(4):
                assert chat(server.url, f"While the remote is gone {i}").status_code == 200
            after = client.stats("tokenizer").routed
            assert after[1] == before[1] and after[0] == before[0] + 4, (before, after)
            client.close()
        finally:
            if remote.poll() is None:
                os.killpg(remote.pid, signal.SIGKILL)
            remote.wait(30)


def tiny_lora():
    """(adapter_config, tensors) of a LoRA of the default model's first q_proj (576 -> 576)."""
    import mlx.core as mx

    mx.random.seed(0)
    tensors = {"model.layers.0.self_attn.q_proj.lora_a": mx.random.normal((576, 4)) * 0.01,
               "model.layers.0.self_attn.q_proj.lora_b": mx.random.normal((4, 576)) * 0.01}
    return {"fine_tune_type": "lora", "num_layers": 30, "lora_parameters": {"rank": 4, "scale": 1.0}}, tensors
