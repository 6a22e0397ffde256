"""A policy network assembled from named blocks (blocks.py) and heads, as policy.json describes it.

Inputs flow as: the conv encoder (if the first block is one) encodes its image input; every other
input is flattened; all are concatenated in declared order; then the blocks run in order, recurrent
ones reading and writing their state. Heads read the last features: `logits` (categorical action),
`mean` and `log_std` (diagonal Gaussian action), `value`, and any named linear `outputs`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn

from .blocks import FEATURE_BLOCKS, ConvEncoder, GRUCore, LSTMCore, conv_encoder
from .errors import PolicyLoadError
from .signature import TensorSpec


class BlockNet(nn.Module):
    """(inputs, state) -> (outputs, new state), all dicts of named [B, ...] arrays."""

    def __init__(self, inputs: Mapping[str, TensorSpec], network: Mapping[str, Any],
                 action: Mapping[str, Any] | None, value: bool) -> None:
        super().__init__()
        blocks = list(network.get("blocks", []))
        if not all(isinstance(b, Mapping) and isinstance(b.get("type"), str) for b in blocks):
            raise PolicyLoadError("network.blocks must be a list of {\"type\": ..., ...} objects")
        self._image: str | None = None
        self.encoder: ConvEncoder | None = None
        features = 0
        if blocks and blocks[0]["type"] == "conv":
            conv = blocks.pop(0)
            images = [n for n, s in inputs.items() if len(s.shape) == 3]
            self._image = conv.get("input", images[0] if len(images) == 1 else None)
            if self._image not in inputs:
                raise PolicyLoadError("conv block: name its image input with 'input'")
            self.encoder = conv_encoder(conv, inputs[self._image].shape)
            features = self.encoder.out_features
        self._flat = [n for n in inputs if n != self._image]
        features += sum(math.prod(inputs[n].shape) for n in self._flat)
        self.blocks = []
        for spec in blocks:
            if spec["type"] not in FEATURE_BLOCKS:
                where = "must be the first block" if spec["type"] == "conv" else "is not a known block"
                raise PolicyLoadError(f"block {spec['type']!r} {where} (blocks: conv, {', '.join(FEATURE_BLOCKS)})")
            block, features = FEATURE_BLOCKS[spec["type"]](spec, features)
            self.blocks.append(block)
        names = [n for b in self.blocks if isinstance(b, (LSTMCore, GRUCore)) for n in b.state_names]
        if len(set(names)) != len(names):
            raise PolicyLoadError("two recurrent blocks share a state name: give them distinct 'name's")
        self.heads, self.output_specs = self._heads(features, network.get("outputs", {}), action, value)
        self.state_specs = {n: TensorSpec((b.hidden,)) for b in self.blocks
                            if isinstance(b, (LSTMCore, GRUCore)) for n in b.state_names}

    def _heads(self, features: int, outputs: Any, action: Mapping[str, Any] | None,
               value: bool) -> tuple[dict[str, nn.Module], dict[str, TensorSpec]]:
        if not isinstance(outputs, Mapping) or not all(isinstance(v, int) and v > 0 for v in outputs.values()):
            raise PolicyLoadError("network.outputs must map output names to sizes")
        heads: dict[str, nn.Module] = {n: nn.Linear(features, size) for n, size in outputs.items()}
        specs = {n: TensorSpec((size,)) for n, size in outputs.items()}
        if action is not None and action["type"] == "categorical":
            heads["logits"], specs["logits"] = nn.Linear(features, action["n"]), TensorSpec((action["n"],))
        if action is not None and action["type"] == "gaussian":
            dim = action["dim"]
            heads["mean"], specs["mean"], specs["log_std"] = nn.Linear(features, dim), TensorSpec((dim,)), TensorSpec((dim,))
            if action.get("log_std", "parameter") == "output":
                heads["log_std"] = nn.Linear(features, dim)
            else:
                self.log_std = mx.full((dim,), float(action.get("init_log_std", 0.0)))
        if value:
            heads["value"], specs["value"] = nn.Linear(features, 1), TensorSpec(())
        return heads, specs

    def __call__(self, inputs: Mapping[str, mx.array],
                 state: Mapping[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        parts = []
        if self.encoder is not None:
            parts.append(self.encoder(inputs[self._image].astype(mx.float32)))
        rows = next(iter(inputs.values())).shape[0]
        parts += [inputs[n].astype(mx.float32).reshape(rows, -1) for n in self._flat]
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        new_state: dict[str, mx.array] = {}
        for block in self.blocks:
            if isinstance(block, (LSTMCore, GRUCore)):
                x, out = block(x, state)
                new_state.update(out)
            else:
                x = block(x)
        outputs = {n: head(x) for n, head in self.heads.items()}
        if "value" in outputs:
            outputs["value"] = outputs["value"][:, 0]
        if "mean" in outputs and "log_std" not in outputs:
            outputs["log_std"] = mx.broadcast_to(self.log_std, outputs["mean"].shape)
        return outputs, new_state
