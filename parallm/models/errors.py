"""The one exception model loading raises for anything a user can get wrong."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model spec, file or directory that cannot be served, with the precise reason.

    Raised for every failure a user can cause (a missing file, an unsupported architecture or
    tensor type, a bad dtype), never for bugs; the message says what was looked for and where.
    """
