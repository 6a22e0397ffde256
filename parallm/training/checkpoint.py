"""Checkpoints in mlx-lm's adapter format, plus what a resumed trainer needs.

    DIR/step-000040/adapters.safetensors     the adapter (mlx-lm names)      } what mlx_lm.generate
    DIR/step-000040/adapter_config.json      fine_tune_type, lora_parameters } --adapter-path reads
    DIR/step-000040/optimizer.safetensors    Adam's moments and step
    DIR/step-000040/trainer_state.json       step, published version, rng state, counters

A checkpoint is written to a temporary folder and renamed into place, so a trainer killed while
saving leaves the previous one intact; only the last `keep_last` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

PREFIX = "step-"
STATE_FILE = "trainer_state.json"


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def version(self) -> int:
        return int(self.state["version"])


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: str | os.PathLike) -> Checkpoint | None:
    """The newest complete checkpoint under `root`, or None."""
    for path in reversed(_step_dirs(Path(root))):
        state_file = path / STATE_FILE
        if state_file.is_file() and (path / "adapters.safetensors").is_file():
            return Checkpoint(path=path, state=json.loads(state_file.read_text()))
    return None


def save(root: str | os.PathLike, step: int, *, weights: dict[str, mx.array], adapter_config: dict[str, Any],
         optimizer: optim.Optimizer, state: dict[str, Any], keep_last: int = 3) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    mx.save_safetensors(str(tmp / "adapters.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    opt_state = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_state)
    (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in _step_dirs(root)[:-max(1, keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _set_leaf(tree: Any, dotted: str, value: mx.array) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value


def restore(checkpoint: Checkpoint, model: nn.Module, optimizer: optim.Optimizer) -> None:
    """Load the adapter weights into `model` (strictly: every tensor must exist with its shape)
    and Adam's state into `optimizer`."""
    weights = mx.load(str(checkpoint.path / "adapters.safetensors"))
    expected = dict(tree_flatten(model.trainable_parameters()))
    wrong = sorted(set(weights) ^ set(expected))
    bad_shapes = [k for k in weights if k in expected and weights[k].shape != expected[k].shape]
    if wrong or bad_shapes:
        raise ValueError(f"checkpoint {checkpoint.path} does not fit this adapter configuration "
                         f"(tensors differing: {(wrong + bad_shapes)[:5]}); point checkpointing.dir elsewhere "
                         "or set checkpointing.resume = false")
    model.load_weights(list(weights.items()), strict=False)
    optimizer.init(model.trainable_parameters())
    opt_file = checkpoint.path / "optimizer.safetensors"
    if opt_file.is_file():
        state = optimizer.state
        for key, value in mx.load(str(opt_file)).items():
            _set_leaf(state, key, value)
    mx.eval(model.parameters(), optimizer.state)
