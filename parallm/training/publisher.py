"""Publishing adapter versions to a running engine: what a trainer (ours or any MLX loop) uses.

    pub = AdapterPublisher(welcome.addresses["adapters"])    # the engine's bound SUB socket
    pub.publish("policy", version=7, weights=dict(tree_flatten(model.trainable_parameters())),
                config={"fine_tune_type": "lora", "num_layers": 16,
                        "lora_parameters": {"rank": 16, "scale": 20.0, "dropout": 0.0}})

The weights travel inline as safetensors bytes in one AdapterPublish message (or `weights` may be
a path to an adapter directory the engine can read). The engine loads each version between two
steps; new requests use it from the next step (docs/adapters.md). PUB is fire-and-forget: a
version the engine rejects is logged there and counted in its stats (`adapter_rejected`); to get
a reply, use the raw client's `load_adapter` instead (the same message, answered by the engine).
`publish_weights` sends a full-weight update of the base model instead, one layer per message.
`publish_policy` sends a served non-LLM policy's full weights (connect the publisher to the policy
stage's `policy_weights` address, or to a list holding it and the engine's `adapters`).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import zmq

from parallm import protocol
from parallm.adapters import save_bytes
from parallm.engine.weights import by_layer
from parallm.keys import client_curve
from parallm.transport import Sender, open_socket


class AdapterPublisher:
    """A PUB socket connected to the engine's `adapters` address."""

    def __init__(self, address: str | list[str], *, ctx: zmq.Context | None = None, settle_s: float = 0.2,
                 server_key: str | None = None, client_key: str | None = None) -> None:
        """Over tcp:// the engine admits only allowed CURVE keys: give the server's public key file and
        this trainer's NAME.key_secret file (or set them once with parallm.transport.set_curve)."""
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        curve = client_curve(server_key, client_key) if server_key and client_key else None
        self.sender = Sender(open_socket(self.ctx, zmq.PUB, address, bind=False, curve=curve))
        self.published = 0
        self._ready_at = time.monotonic() + settle_s  # PUB drops messages sent before the connection is up

    def publish(self, name: str, version: int = 0, weights: Mapping[str, mx.array] | str | Path | bytes = b"",
                config: Mapping[str, Any] | None = None, *, format: str = "auto") -> None:
        """Send one version. `version` 0 lets the engine number it (latest + 1); otherwise it must
        be larger than the latest. `weights`: tensors by name (mlx-lm's trainable_parameters()
        names, or PEFT's), safetensors bytes, or a path to an adapter directory on the engine's machine."""
        wait = self._ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        path = ""
        if isinstance(weights, (str, Path)):
            path, blob = str(weights), b""
        elif isinstance(weights, (bytes, bytearray)):
            blob = bytes(weights)
        else:
            blob = save_bytes(dict(weights))
        self.sender.send(protocol.AdapterPublish(name=name, version=int(version), config=dict(config or {}),
                                                 weights=blob, path=path, format=format))  # type: ignore[arg-type]
        self.published += 1

    def publish_policy(self, model: str, weights: Mapping[str, mx.array] | bytes, version: int = 0) -> None:
        """Send every weight of the served policy `model` (named as its parameters, e.g.
        `dict(tree_flatten(net.parameters()))`, or safetensors bytes) in one PolicyWeights message.
        `version` 0 lets the policy stage number it (latest + 1); otherwise it must be larger than the
        latest. The stage applies it between two batches; a version it refuses is counted in its stats."""
        wait = self._ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        blob = bytes(weights) if isinstance(weights, (bytes, bytearray)) else save_bytes(dict(weights))
        self.sender.send(protocol.PolicyWeights(model=model, weights=blob, version=int(version)))
        self.published += 1

    def publish_weights(self, weights: Mapping[str, mx.array], version: int = 0) -> str:
        """Send new base-model weights (a full-weight policy update) in chunks of one layer each: the
        engine checks and stages each chunk as it comes and applies the update once the last is in,
        never holding more than one layer's new copy in memory; an update that fails midway changes
        nothing. `version` 0 lets the engine number it. Returns the update id: the engine counts the
        update in `weights_updates`, or says why it refused it in its stats' `weights` (also in
        GET /v1/training/status)."""
        wait = self._ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        update_id = uuid.uuid4().hex
        groups = by_layer(weights)
        for i, group in enumerate(groups):
            self.sender.send(protocol.WeightsUpdate(weights=save_bytes(group), update_id=update_id, chunk=i,
                                                    chunks=len(groups), version=int(version)))
        self.published += 1
        return update_id

    def training_phase(self, trainer: str, updating: bool, lease_s: float = 30.0) -> None:
        """Tell the engine that `trainer`'s update began or still runs (`updating`; it lapses `lease_s`
        seconds after this message) or ended: meanwhile the engine leaves engine.training_share of the
        device to it."""
        wait = self._ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.sender.send(protocol.TrainingPhase(trainer=trainer, updating=updating, lease_s=lease_s))

    def close(self, linger_ms: int = 5000) -> None:
        """Close, giving queued versions up to `linger_ms` to leave (a PUB closed at once drops them)."""
        self.sender.sock.close(linger=linger_ms)
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> "AdapterPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
