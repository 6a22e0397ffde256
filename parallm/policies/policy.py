"""A served policy: its network with versioned weights, a forward on host arrays, and `act`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..adapters.errors import AdapterError
from ..adapters.safetensors_io import read_bytes
from .errors import PolicyLoadError
from .signature import DTYPES, Signature
from .spec import SPEC_FILE, WEIGHTS_FILE, PolicySpec, read_spec


@dataclass(frozen=True, slots=True)
class ActResult:
    """What `act` returns for a batch: row-aligned arrays, and the weights' version that made them."""

    actions: np.ndarray
    action_log_probs: np.ndarray
    value_estimates: np.ndarray | None
    new_state: dict[str, np.ndarray]
    version: int


class Policy:
    """One named policy. Not thread-safe: one loop drives it (the policy stage)."""

    def __init__(self, name: str, spec: PolicySpec, net: nn.Module, version: int = 0) -> None:
        self.name = name
        self.spec = spec
        self.net = net
        self.version = version
        self._shapes = {k: v.shape for k, v in tree_flatten(net.parameters())}

    @classmethod
    def load(cls, name: str, path: str | Path) -> "Policy":
        """A policy directory: policy.json and weights.safetensors."""
        path = Path(path)
        spec = read_spec(path)
        policy = cls(name, spec, spec.build())
        try:
            data = (path / WEIGHTS_FILE).read_bytes()
        except OSError as e:
            raise PolicyLoadError(f"{path / WEIGHTS_FILE}: {e}") from None
        policy.set_weights(data, 0)
        return policy

    @property
    def signature(self) -> Signature:
        return self.spec.signature

    def set_weights(self, data: bytes, version: int) -> None:
        """Replace every weight from a safetensors blob (all of them, same names and shapes)."""
        try:
            tensors, bad = read_bytes(data)
        except AdapterError as e:
            raise PolicyLoadError(f"weights: {e}") from None
        if bad:
            raise PolicyLoadError(f"weights: {bad[0]} holds NaN or infinity")
        missing = sorted(set(self._shapes) - set(tensors))
        extra = sorted(set(tensors) - set(self._shapes))
        if missing or extra:
            raise PolicyLoadError(f"weights: missing {missing[:5]}, unexpected {extra[:5]}")
        for k, v in tensors.items():
            if v.shape != self._shapes[k]:
                raise PolicyLoadError(f"weights: {k} has shape {list(v.shape)}, the network {list(self._shapes[k])}")
        self.net.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                               for k, v in tensors.items()])
        mx.eval(self.net.parameters())
        self.version = version

    def weights_bytes(self) -> bytes:
        """The current weights as safetensors (what `set_weights` and a weight update take)."""
        from ..adapters.safetensors_io import save_bytes
        return save_bytes(dict(tree_flatten(self.net.parameters())))

    def forward(self, inputs: Mapping[str, np.ndarray],
                state: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The network on checked host arrays: (named outputs, new state) as host arrays."""
        outs, new_state = self.net({k: mx.array(v) for k, v in inputs.items()},
                                   {k: mx.array(v) for k, v in state.items()})
        mx.eval(outs, new_state)
        specs = self.signature
        return ({k: np.array(outs[k], copy=False).astype(DTYPES[s.dtype], copy=False) for k, s in specs.outputs.items()},
                {k: np.array(new_state[k], copy=False).astype(DTYPES[s.dtype], copy=False)
                 for k, s in specs.state.items()})

    def act(self, inputs: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray],
            seeds: np.ndarray, deterministic: np.ndarray) -> ActResult:
        """Actions for checked inputs and state: one forward, then each row's own draw."""
        dist = self.spec.distribution
        if dist is None:
            raise ValueError(f"policy {self.name!r} has no action head (serve it with /v1/predict)")
        outs, new_state = self.forward(inputs, state)
        actions, log_probs = dist.act(outs, seeds, deterministic)
        values = outs["value"].astype(np.float32) if self.spec.value else None
        return ActResult(actions, log_probs, values, new_state, self.version)


def save_policy(path: str | Path, spec: Mapping, net: nn.Module | None = None, seed: int = 0) -> Path:
    """Write a policy directory from a policy.json dict (and a network; else a fresh seeded one)."""
    import json

    from .spec import parse_spec
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    parsed = parse_spec(spec)
    if net is None:
        mx.random.seed(seed)
        net = parsed.build()
    (path / SPEC_FILE).write_text(json.dumps(spec, indent=1))
    mx.save_safetensors(str(path / WEIGHTS_FILE), dict(tree_flatten(net.parameters())))
    return path
