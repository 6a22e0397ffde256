"""Adapter versions published while perf/bench_parallel.py measures: do they land on every rank and
replica, in the same version?

`Publishing` (one per server): `publish(v)` sends version v of a random LoRA of every layer's q_proj
and o_proj (under tensor parallelism one is split by output features, the other by input features)
on the trainer's PUB socket (the engine's `adapters` address), as the default policy, so every
request of the run (which names no adapter) runs under it. Around each run `during(run)` publishes
a new version every `every_s` seconds from a thread, while another thread sends probe requests one
after another over HTTP (POST /generate in SGLang's shape, whose meta_info names the version each
token ran under). Afterwards it waits until every replica and every rank reports the last version
(replica 0's stats: EngineStats.replicas, .ranks) and returns what was seen.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

NAME = "bench-lora"
RANK = 8
TARGETS = ("self_attn.q_proj", "self_attn.o_proj")
SETTLE_S = 60.0


def lora_tensors(model_dir: Path, seed: int) -> tuple[dict, dict[str, Any]]:
    """(adapter_config, tensors) of a small random LoRA of the model in `model_dir` (shapes read lazily)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from parallm.adapters.lora import linear_dims

    model, _ = load_model(Path(model_dir), lazy=True, strict=False)
    mx.random.seed(seed)
    tensors: dict[str, Any] = {}
    for path, module in model.named_modules():
        if path.endswith(TARGETS) and hasattr(module, "weight"):
            in_dims, out_dims = linear_dims(module)
            tensors[f"{path}.lora_a"] = (mx.random.normal((in_dims, RANK)) * 0.01).astype(mx.bfloat16)
            tensors[f"{path}.lora_b"] = (mx.random.normal((RANK, out_dims)) * 0.01).astype(mx.bfloat16)
    if not tensors:
        raise ValueError(f"no {' or '.join(TARGETS)} layer in {model_dir}")
    layers = len(getattr(model, "layers", [])) or 1
    config = {"fine_tune_type": "lora", "num_layers": layers,
              "lora_parameters": {"rank": RANK, "scale": 1.0, "dropout": 0.0, "keys": list(TARGETS)}}
    return config, tensors


def served_versions(stats: Any, name: str = NAME) -> list[dict[str, Any]]:
    """The latest version of `name` each replica (and each rank of a tensor-parallel one) reports."""
    out = []
    for replica in [stats, *stats.replicas]:
        if replica.ranks:
            out += [{"replica": replica.replica, "rank": r.rank, "version": r.policy.get(name, 0), "step": r.step,
                     "agrees": r.agrees} for r in replica.ranks]
        else:
            out.append({"replica": replica.replica, "rank": 0, "version": replica.adapters.latest.get(name, 0)})
    return out


class Publishing:
    """Adapter versions published to one server (module docstring)."""

    def __init__(self, server: Any, model_dir: Path, every_s: float, replicas: int) -> None:
        from parallm.client import Client
        from parallm.training.publisher import AdapterPublisher

        self.server = server
        self.every_s = every_s
        self.replicas = replicas
        self.client = Client(server.router, timeout=60)
        self.publisher = AdapterPublisher(self.client.welcome.addresses["adapters"])
        time.sleep(0.5)  # a PUB socket drops what it sends before its connection is up
        self.config, self.tensors = lora_tensors(model_dir, seed=0)
        self.version = 0

    def publish(self) -> int:
        """The next version (the tensors scaled, so each version differs), made the default policy."""
        from parallm import protocol
        from parallm.adapters import save_bytes

        self.version += 1
        scale = 1.0 + 0.01 * self.version
        blob = save_bytes({k: v * scale for k, v in self.tensors.items()})
        self.publisher.sender.send(protocol.AdapterPublish(name=NAME, version=self.version, config=self.config,
                                                           weights=blob, make_default=True))
        return self.version

    def during(self, run: Callable[[], dict]) -> tuple[dict, dict[str, Any]]:
        """`run()`'s result, with versions published and probes sent while it runs; then what landed where."""
        first = self.publish()
        self.settle(first)
        stop = threading.Event()
        published, probes = [first], []

        def publishing() -> None:
            while not stop.wait(self.every_s):
                published.append(self.publish())

        def probing() -> None:
            import httpx

            with httpx.Client(timeout=600) as http:
                while not stop.is_set():
                    probes.append(self.probe(http))

        threads = [threading.Thread(target=publishing, daemon=True), threading.Thread(target=probing, daemon=True)]
        for t in threads:
            t.start()
        try:
            result = run()
        finally:
            stop.set()
            for t in threads:
                t.join(600)
        at_end = served_versions(self.client.stats())
        served, seconds = self.settle(published[-1])
        versions = sorted({v for p in probes for v in p})
        return result, {"published": published, "served_at_end": at_end, "served": served,
                        "settled_s": round(seconds, 2), "probes": len(probes), "probe_versions": versions,
                        "probes_switched_mid_request": sum(1 for p in probes if len(set(p)) > 1)}

    def probe(self, http: Any) -> list[int]:
        """One short greedy request over HTTP; the versions its tokens ran under."""
        r = http.post(f"{self.server.url}/generate", json={
            "text": "Probe: count to ten.", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        r.raise_for_status()
        return [int(v) for _, v in r.json()["meta_info"]["versions"]]

    def settle(self, version: int) -> tuple[list[dict[str, Any]], float]:
        """Wait until every replica and rank reports `version` (probes make the engines step, so the
        ranks confirm it); (what each reports, seconds waited). Raises after SETTLE_S."""
        import httpx

        t0 = time.monotonic()
        with httpx.Client(timeout=600) as http:
            while True:
                self.probe(http)
                served = served_versions(self.client.stats())
                if len({s["replica"] for s in served}) == self.replicas and \
                        all(s["version"] == version for s in served):
                    return served, time.monotonic() - t0
                if time.monotonic() - t0 > SETTLE_S:
                    raise RuntimeError(f"adapter version {version} did not reach every replica and rank within "
                                       f"{SETTLE_S:g} s: {served}")
                time.sleep(0.2)

    def close(self) -> None:
        self.publisher.close()
        self.client.close()
