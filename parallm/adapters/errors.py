"""The one error every adapter problem raises: a precise message, and an HTTP-style status."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter cannot be loaded or used. Nothing already serving is changed when it is raised.

    `status`: 400 (the adapter is bad), 404 (no such adapter or version), 409 (a version conflict).
    """

    def __init__(self, message: str, status: int = 400, code: str = "invalid_adapter") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
