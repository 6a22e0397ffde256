"""The two ways a policy can be wrong: its files (PolicyLoadError) or a request's tensors (TensorError)."""

from __future__ import annotations


class PolicyLoadError(ValueError):
    """A policy directory that cannot be served: a bad policy.json, unknown block, missing or
    mis-shaped weights. Raised at load time (or for a weight update, which is then refused)."""


class TensorError(ValueError):
    """A request tensor that does not fit the model's signature (missing, wrong shape or dtype,
    NaN, undecodable). `tensor` names it; the HTTP layer answers 400 with this message."""

    def __init__(self, tensor: str, why: str) -> None:
        super().__init__(f"tensor '{tensor}': {why}")
        self.tensor = tensor
        self.why = why
