"""Counter-based uniforms: a row's draws depend only on its seed, never on what it is batched with.

SplitMix64 (Steele et al.) of seed + k * golden-ratio increment gives draw k of a row; a uniform is its
top 53 bits over 2^53, in (0, 1). Vectorised in numpy over rows and draws, and simple enough to
reproduce in any language (docs/protocol.md).
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
MASK64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def row_seeds(seed: int, rows: int) -> np.ndarray:
    """The seeds of a request's rows: row i of a request seeded `seed` draws from mix(seed + i)."""
    base = np.uint64(seed & MASK64)
    with np.errstate(over="ignore"):
        return _mix(base + np.arange(rows, dtype=np.uint64))


def uniforms(seeds: np.ndarray, count: int) -> np.ndarray:
    """[rows, count] uniforms in (0, 1): draw k of row r from seeds[r]."""
    with np.errstate(over="ignore"):
        z = seeds[:, None] + _GOLDEN * np.arange(1, count + 1, dtype=np.uint64)[None, :]
        bits = _mix(z) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) / float(1 << 53)
