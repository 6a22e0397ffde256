"""Count the primitives of an MLX graph (what `mx.export_to_dot` draws as operations), for tests that
pin how many operations a pass builds."""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path

import mlx.core as mx


def primitives(arrays: list[mx.array]) -> collections.Counter:
    with tempfile.NamedTemporaryFile("r+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        text = Path(f.name).read_text()
    return collections.Counter(m.group(1) for line in text.splitlines()
                               if "shape=rectangle" in line and (m := re.search(r'label ="([^"]*)"', line)))
