"""policy.json: what a policy directory declares, read and checked once.

    {"format": "parallm-policy/1",
     "inputs": {"obs": {"shape": [null, 4], "dtype": "float32"}},
     "network": {"blocks": [{"type": "mlp", "sizes": [64, 64]}, {"type": "lstm", "hidden": 32}],
                 "outputs": {"aux": 3}},
     "action": {"type": "categorical", "n": 2},          (or gaussian with "dim"; absent: predict only)
     "value": true}

or, instead of "network", a user module by import path whose outputs and state are declared:

     "module": {"path": "my_pkg.nets:Net", "args": {...},
                "outputs": {"logits": {"shape": [null, 2]}}, "state": {"h": {"shape": [null, 16]}}}

Weights are `weights.safetensors` beside it, named as the module's parameters.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import mlx.nn as nn

from .distributions import Categorical, DiagGaussian, Distribution
from .errors import PolicyLoadError
from .network import BlockNet
from .signature import Signature, TensorSpec

FORMAT = "parallm-policy/1"
SPEC_FILE = "policy.json"
WEIGHTS_FILE = "weights.safetensors"
_KEYS = {"format", "inputs", "network", "module", "action", "value", "description"}


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy.json: the network to build, its signature and its action distribution."""

    raw: Mapping[str, Any]
    signature: Signature
    distribution: Distribution | None
    value: bool

    def build(self) -> nn.Module:
        """The network, with fresh (random) weights."""
        if "network" in self.raw:
            return BlockNet(self.signature.inputs, self.raw["network"], self.raw.get("action"), self.value)
        return _user_module(self.raw["module"])


def read_spec(path: str | Path) -> PolicySpec:
    """The spec of a policy directory (or of a policy.json file itself)."""
    path = Path(path)
    file = path / SPEC_FILE if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise PolicyLoadError(f"{file}: {e}") from None
    return parse_spec(raw)


def parse_spec(raw: Any) -> PolicySpec:
    if not isinstance(raw, Mapping) or raw.get("format") != FORMAT:
        raise PolicyLoadError(f"a policy.json is an object with \"format\": \"{FORMAT}\"")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise PolicyLoadError(f"policy.json: unknown keys {unknown}")
    if ("network" in raw) == ("module" in raw):
        raise PolicyLoadError("policy.json: give exactly one of 'network' (built-in blocks) or 'module' (import path)")
    if not isinstance(raw.get("inputs"), Mapping) or not raw["inputs"]:
        raise PolicyLoadError("policy.json: 'inputs' must name at least one tensor")
    inputs = {n: TensorSpec.parse(n, s) for n, s in raw["inputs"].items()}
    value = raw.get("value", False)
    if not isinstance(value, bool):
        raise PolicyLoadError("policy.json: 'value' must be true or false")
    distribution = _distribution(raw.get("action"))
    if "network" in raw:
        if not isinstance(raw["network"], Mapping):
            raise PolicyLoadError("policy.json: 'network' must be an object")
        net = BlockNet(inputs, raw["network"], raw.get("action"), value)
        signature = Signature(inputs, dict(net.state_specs), dict(net.output_specs))
    else:
        module = raw["module"]
        if not isinstance(module, Mapping) or not isinstance(module.get("path"), str):
            raise PolicyLoadError("policy.json: 'module' must be {\"path\": \"pkg.mod:Class\", ...}")
        outputs = {n: TensorSpec.parse(n, s) for n, s in module.get("outputs", {}).items()}
        state = {n: TensorSpec.parse(n, s) for n, s in module.get("state", {}).items()}
        signature = Signature(inputs, state, outputs)
    _check_heads(signature, distribution, value)
    return PolicySpec(raw, signature, distribution, value)


def _distribution(action: Any) -> Distribution | None:
    if action is None:
        return None
    if not isinstance(action, Mapping) or action.get("type") not in ("categorical", "gaussian"):
        raise PolicyLoadError("policy.json: 'action' must be {\"type\": \"categorical\" | \"gaussian\", ...}")
    key = "n" if action["type"] == "categorical" else "dim"
    size = action.get(key)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise PolicyLoadError(f"policy.json: a {action['type']} action needs a positive '{key}'")
    if action["type"] == "gaussian" and action.get("log_std", "parameter") not in ("parameter", "output"):
        raise PolicyLoadError("policy.json: a gaussian action's 'log_std' is \"parameter\" or \"output\"")
    return Categorical(size) if action["type"] == "categorical" else DiagGaussian(size)


def _check_heads(signature: Signature, distribution: Distribution | None, value: bool) -> None:
    """The outputs the action distribution and the value head read are declared, with their shapes."""
    size = (distribution.n if isinstance(distribution, Categorical) else
            distribution.dim if isinstance(distribution, DiagGaussian) else 0)
    wanted = {p: (size,) for p in (distribution.params if distribution else ())}
    if value:
        wanted["value"] = ()
    for name, shape in wanted.items():
        spec = signature.outputs.get(name)
        if spec is None or spec.shape != shape or spec.dtype not in ("float32", "float16"):
            raise PolicyLoadError(f"policy.json: the module must output '{name}' of shape {[None, *shape]} (float)")


def _user_module(module: Mapping[str, Any]) -> nn.Module:
    path = module["path"]
    mod_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise PolicyLoadError(f"module {path!r} cannot be imported: {e}") from None
    args = module.get("args", {})
    if not isinstance(args, Mapping):
        raise PolicyLoadError("module.args must be an object")
    net = factory(**args)
    if not isinstance(net, nn.Module):
        raise PolicyLoadError(f"module {path!r} did not make an mlx.nn.Module")
    return net
