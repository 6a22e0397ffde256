"""Tensors to and from their wire forms: JSON (nested lists), base64 of packed little-endian bytes
(HTTP) and packed bytes with a dtype and a shape (ZeroMQ). Every failure names the tensor."""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from .. import protocol
from .errors import TensorError
from .signature import DTYPES


def from_buffer(name: str, dtype: str, shape: list[int] | tuple[int, ...], data: bytes) -> np.ndarray:
    """A tensor from packed little-endian bytes (row-major) of `dtype` and `shape`."""
    if dtype not in DTYPES:
        raise TensorError(name, f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise TensorError(name, f"shape {list(shape)} must be a list of non-negative integers")
    want = DTYPES[dtype]
    count = math.prod(shape)
    if len(data) != count * want.itemsize:
        raise TensorError(name, f"holds {len(data)} bytes where shape {list(shape)} of {dtype} needs "
                                f"{count * want.itemsize}")
    return np.frombuffer(data, dtype=want).reshape(shape)


_NAMES = {np.dtype(name): name for name in DTYPES}  # by dtype object: `dtype.name` is slow (~40 us) in numpy 2


def to_buffer(array: np.ndarray) -> tuple[str, list[int], bytes]:
    """(dtype, shape, packed little-endian bytes) of an array whose dtype is one of DTYPES."""
    name = _NAMES.get(array.dtype) or _NAMES.get(array.dtype.newbyteorder("<"))
    if name is None:
        raise ValueError(f"dtype {array.dtype} cannot travel")
    return name, list(array.shape), np.ascontiguousarray(array, dtype=DTYPES[name]).tobytes()


def from_json(name: str, value: Any) -> np.ndarray:
    """A tensor from its JSON form: nested lists of numbers, or {"b64", "dtype", "shape"}."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"b64", "dtype", "shape"})
        if unknown or not {"b64", "dtype", "shape"} <= set(value):
            raise TensorError(name, "a base64 tensor is {\"b64\": ..., \"dtype\": ..., \"shape\": [...]}")
        if not isinstance(value["b64"], str) or not isinstance(value["shape"], list):
            raise TensorError(name, "b64 must be a string and shape a list")
        try:
            data = base64.b64decode(value["b64"], validate=True)
        except (binascii.Error, ValueError):
            raise TensorError(name, "b64 is not valid base64") from None
        return from_buffer(name, value["dtype"], value["shape"], data)
    if not isinstance(value, list):
        raise TensorError(name, "must be a (nested) list of numbers or a base64 tensor object")
    try:
        array = np.array(value)
    except ValueError:
        raise TensorError(name, "is a ragged list (rows of different lengths)") from None
    if array.dtype == object or array.dtype.kind not in "fiub":
        raise TensorError(name, "must hold numbers only, in rows of equal length")
    if array.dtype.kind in "iu":
        return array.astype(np.int64)
    return array


def to_json(array: np.ndarray, b64: bool) -> Any:
    """The JSON form of an output tensor: nested lists, or base64 of its packed bytes."""
    if not b64:
        return array.tolist()
    dtype, shape, data = to_buffer(array)
    return {"b64": base64.b64encode(data).decode("ascii"), "dtype": dtype, "shape": shape}


def wire(array: np.ndarray) -> protocol.Tensor:
    """The wire form of an array (protocol.Tensor)."""
    dtype, shape, data = to_buffer(array)
    return protocol.Tensor(dtype=dtype, shape=shape, data=data)


def unwire(name: str, tensor: protocol.Tensor) -> np.ndarray:
    """The array a wire tensor holds; TensorError naming it when its bytes do not fit."""
    return from_buffer(name, tensor.dtype, tensor.shape, tensor.data)
