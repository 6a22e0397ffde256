"""What every configuration field is annotated with: its description, which is its documentation and
its `--help` text (schema.py, trainer_schema.py)."""

from __future__ import annotations

from msgspec import Meta


def described(text: str) -> Meta:
    return Meta(description=text)
