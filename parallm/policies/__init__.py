"""Non-LLM policies and networks (`/v1/rl/act`, `/v1/predict`): the model format (policy.json +
weights.safetensors), its signature, a registry of building blocks, seeded action distributions,
and the tensors' wire forms. No sockets here: the policy stage drives these.

The names that need MLX (Policy, the spec's builders) load on first use, so that ingress and clients
can use the tensors' wire forms and the client without importing MLX.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .errors import PolicyLoadError, TensorError
from .signature import Signature, TensorSpec

_LAZY = {"ActResult": ".policy", "Policy": ".policy", "save_policy": ".policy", "FORMAT": ".spec",
         "PolicySpec": ".spec", "parse_spec": ".spec", "read_spec": ".spec"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'parallm.policies' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)


__all__ = ["ActResult", "FORMAT", "Policy", "PolicyLoadError", "PolicySpec", "Signature", "TensorError",
           "TensorSpec", "parse_spec", "read_spec", "save_policy"]
