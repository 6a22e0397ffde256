"""A policy's signature: named inputs, recurrent state and outputs, each a shape (batch first) and
a dtype, and the checks a request's tensors pass before they reach the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .errors import PolicyLoadError, TensorError

DTYPES: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<") for name in
                               ("float32", "float16", "float64", "int32", "int64", "int8", "uint8", "bool")}
"""The dtypes a tensor may have on the wire (always little-endian)."""

FLOATS = ("float32", "float16", "float64")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor: `shape` is the per-row shape (the batch dimension comes first and is not
    listed); `dtype` one of DTYPES."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @classmethod
    def parse(cls, name: str, raw: Any) -> "TensorSpec":
        """From policy.json's {"shape": [null, 4], "dtype": "float32"} (null: the batch dimension)."""
        if not isinstance(raw, Mapping) or not isinstance(raw.get("shape"), list):
            raise PolicyLoadError(f"tensor '{name}': needs {{\"shape\": [null, ...], \"dtype\": ...}}")
        shape = raw["shape"]
        if not shape or shape[0] is not None:
            raise PolicyLoadError(f"tensor '{name}': the first dimension of its shape is the batch (null)")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape[1:]):
            raise PolicyLoadError(f"tensor '{name}': dimensions after the batch must be positive integers")
        dtype = raw.get("dtype", "float32")
        if dtype not in DTYPES:
            raise PolicyLoadError(f"tensor '{name}': dtype {dtype!r} is not one of {sorted(DTYPES)}")
        return cls(tuple(shape[1:]), dtype)

    def to_json(self) -> dict[str, Any]:
        return {"shape": [None, *self.shape], "dtype": self.dtype}

    def check(self, name: str, array: np.ndarray, rows: int | None = None) -> np.ndarray:
        """`array` as this tensor wants it (cast to its dtype when that is exact), or TensorError."""
        if tuple(array.shape[1:]) != self.shape or array.ndim != len(self.shape) + 1:
            raise TensorError(name, f"shape {list(array.shape)} does not match {[None, *self.shape]}"
                                    " (batch first)")
        if rows is not None and array.shape[0] != rows:
            raise TensorError(name, f"has {array.shape[0]} rows where the request has {rows}")
        want = DTYPES[self.dtype]
        if array.dtype.kind == "f" and array.size and not np.isfinite(array).all():
            raise TensorError(name, "holds NaN or infinity")
        if array.dtype == want:
            return array
        if self.dtype in FLOATS and array.dtype.kind in "fiub":
            return array.astype(want)
        if array.dtype.kind in "iub" and want.kind in "iu":
            cast = array.astype(want)
            if np.array_equal(cast, array):
                return cast
            raise TensorError(name, f"values do not fit dtype {self.dtype}")
        if array.dtype.kind == "f" and want.kind in "iub":
            raise TensorError(name, f"dtype {array.dtype.name} given where the model takes {self.dtype}")
        raise TensorError(name, f"dtype {array.dtype.name} given where the model takes {self.dtype}")


@dataclass(frozen=True, slots=True)
class Signature:
    """Named inputs, recurrent state (zeros at an episode's start) and outputs of a policy."""

    inputs: dict[str, TensorSpec]
    state: dict[str, TensorSpec] = field(default_factory=dict)
    outputs: dict[str, TensorSpec] = field(default_factory=dict)

    def check_inputs(self, tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """(the inputs cast to their dtypes, the batch size); TensorError naming the first bad one."""
        unknown = sorted(set(tensors) - set(self.inputs))
        if unknown:
            raise TensorError(unknown[0], f"is not an input of this model (inputs: {sorted(self.inputs)})")
        out: dict[str, np.ndarray] = {}
        rows: int | None = None
        for name, spec in self.inputs.items():
            if name not in tensors:
                raise TensorError(name, "is missing")
            out[name] = spec.check(name, tensors[name], rows)
            rows = out[name].shape[0]
        if not rows:
            raise TensorError(next(iter(self.inputs)), "has no rows")
        return out, rows

    def check_state(self, tensors: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """The recurrent state given by a client, all of it, with `rows` rows."""
        unknown = sorted(set(tensors) - set(self.state))
        if unknown:
            raise TensorError(unknown[0], f"is not a hidden state of this model (state: {sorted(self.state)})")
        out = {}
        for name, spec in self.state.items():
            if name not in tensors:
                raise TensorError(name, "is missing (a hidden state is given whole or not at all)")
            out[name] = spec.check(name, tensors[name], rows)
        return out

    def zero_state(self, rows: int) -> dict[str, np.ndarray]:
        return {n: np.zeros((rows, *s.shape), DTYPES[s.dtype]) for n, s in self.state.items()}

    def to_json(self) -> dict[str, Any]:
        return {part: {n: s.to_json() for n, s in getattr(self, part).items()}
                for part in ("inputs", "state", "outputs")}
