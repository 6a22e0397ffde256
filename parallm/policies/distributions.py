"""Action distributions, on the host in float64: their mode, seeded samples and exact log-probs.

A network gives the parameters (`logits`; `mean` and `log_std`); these turn them into actions.
Each row draws from its own seed (rng.py), so a row's action does not depend on its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np

from .rng import uniforms

_LOG_2PI = math.log(2.0 * math.pi)


class Distribution(Protocol):
    """What a policy's action head computes from the network's outputs."""

    params: tuple[str, ...]   # the network outputs it reads

    def act(self, outputs: Mapping[str, np.ndarray], seeds: np.ndarray,
            deterministic: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(actions, their log-probs as float32) for every row; `deterministic` rows take the mode."""
        ...

    def log_prob(self, outputs: Mapping[str, np.ndarray], actions: np.ndarray) -> np.ndarray:
        ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass(frozen=True, slots=True)
class Categorical:
    """n discrete actions from `logits` [B, n]; a sample inverts the CDF at one uniform per row."""

    n: int
    params: tuple[str, ...] = ("logits",)

    def act(self, outputs: Mapping[str, np.ndarray], seeds: np.ndarray,
            deterministic: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logp = log_softmax(outputs["logits"])
        cdf = np.cumsum(np.exp(logp), axis=-1)
        u = uniforms(seeds, 1) * cdf[:, -1:]
        sampled = np.minimum((cdf < u).sum(axis=-1), self.n - 1)
        actions = np.where(deterministic, logp.argmax(axis=-1), sampled).astype(np.int64)
        return actions, logp[np.arange(len(actions)), actions].astype(np.float32)

    def log_prob(self, outputs: Mapping[str, np.ndarray], actions: np.ndarray) -> np.ndarray:
        logp = log_softmax(outputs["logits"])
        return logp[np.arange(len(actions)), actions].astype(np.float32)


@dataclass(frozen=True, slots=True)
class DiagGaussian:
    """`dim` continuous actions from `mean` and `log_std` [B, dim]; samples by Box-Muller."""

    dim: int
    params: tuple[str, ...] = ("mean", "log_std")

    def act(self, outputs: Mapping[str, np.ndarray], seeds: np.ndarray,
            deterministic: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mean = outputs["mean"].astype(np.float64)
        std = np.exp(outputs["log_std"].astype(np.float64))
        u = uniforms(seeds, 2 * self.dim)
        z = np.sqrt(-2.0 * np.log(u[:, :self.dim])) * np.cos(2.0 * math.pi * u[:, self.dim:])
        actions = np.where(deterministic[:, None], mean, mean + std * z).astype(np.float32)
        return actions, self.log_prob(outputs, actions)

    def log_prob(self, outputs: Mapping[str, np.ndarray], actions: np.ndarray) -> np.ndarray:
        mean = outputs["mean"].astype(np.float64)
        log_std = outputs["log_std"].astype(np.float64)
        z = (actions.astype(np.float64) - mean) / np.exp(log_std)
        return (-0.5 * z * z - log_std - 0.5 * _LOG_2PI).sum(axis=-1).astype(np.float32)
