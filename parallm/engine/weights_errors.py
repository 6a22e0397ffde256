"""The error of a full-weight update that cannot be applied (parallm/engine/weights.py)."""

from __future__ import annotations


class WeightsError(Exception):
    """A weight update that cannot be applied; `status`/`code` as the HTTP answer would give them."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_weights") -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code
