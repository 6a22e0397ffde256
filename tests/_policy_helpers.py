"""Small policy directories for tests: an MLP categorical, an LSTM categorical, a Gaussian with a value
head, and an MLP regressor for /v1/predict. Seeded, so every run builds the same weights."""

from __future__ import annotations

import math
from pathlib import Path

from parallm.policies import save_policy

MLP_CATEGORICAL = {"format": "parallm-policy/1", "inputs": {"obs": {"shape": [None, 4]}},
                   "network": {"blocks": [{"type": "mlp", "sizes": [16, 16], "activation": "tanh"}]},
                   "action": {"type": "categorical", "n": 3}, "value": True}
LSTM_CATEGORICAL = {"format": "parallm-policy/1", "inputs": {"obs": {"shape": [None, 4]}},
                    "network": {"blocks": [{"type": "mlp", "sizes": [16]}, {"type": "lstm", "hidden": 8}]},
                    "action": {"type": "categorical", "n": 2}, "value": True}
GAUSSIAN = {"format": "parallm-policy/1", "inputs": {"obs": {"shape": [None, 3]}},
            "network": {"blocks": [{"type": "mlp", "sizes": [16]}]},
            "action": {"type": "gaussian", "dim": 2, "init_log_std": -0.5}, "value": True}
REGRESSOR = {"format": "parallm-policy/1", "inputs": {"x": {"shape": [None, 2]}, "k": {"shape": [None], "dtype": "int32"}},
             "network": {"blocks": [{"type": "mlp", "sizes": [8]}], "outputs": {"y": 3}}}


def make_policies(root: Path) -> dict[str, Path]:
    """name -> directory of each test policy under `root`."""
    specs = {"mlp": MLP_CATEGORICAL, "lstm": LSTM_CATEGORICAL, "gauss": GAUSSIAN, "reg": REGRESSOR}
    return {name: save_policy(root / name, spec, seed=i + 1) for i, (name, spec) in enumerate(specs.items())}


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty; z the normal quantile)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3
