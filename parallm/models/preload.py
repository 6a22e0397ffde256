"""Adapters loaded when the engine starts: `--adapter NAME=PATH` (adapters.preload, repeatable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def parse_adapter_specs(specs: list[str]) -> list[tuple[str, str]]:
    """[(name, path)] from NAME=PATH entries; a malformed entry, a repeated name or a missing
    directory is a ValueError naming it (the engine stage refuses to start)."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"adapters.preload entry {spec!r} is not NAME=PATH")
        if any(name == n for n, _ in out):
            raise ValueError(f"adapters.preload names adapter {name!r} twice")
        if not Path(path).expanduser().exists():
            raise ValueError(f"adapters.preload {name}: {path} does not exist")
        out.append((name, str(Path(path).expanduser().resolve())))
    return out


def load_adapters_at_start(engine: Any, specs: list[str]) -> list[str]:
    """Load every NAME=PATH adapter into `engine` (an Engine) before it serves; the names loaded.
    The operator named these paths, so adapters.allowed_dirs (for paths sent over HTTP) does not
    apply. Raises ValueError or parallm.adapters.AdapterError."""
    names = []
    for name, path in parse_adapter_specs(specs):
        engine.load_adapter(name, path=path)
        names.append(name)
    return names
