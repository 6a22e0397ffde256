"""Tensors on the wire: an image's pixel values as the tokenizer stage's processor made them, sent to
the engine as raw little-endian bytes with their dtype and shape (never pickled, never a URL)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from msgspec import Struct

__all__ = ["Tensor", "TensorDtype", "pack_tensor", "unpack_tensor", "MAX_TENSOR_BYTES"]

TensorDtype = Literal["float32", "float16", "uint8"]
MAX_TENSOR_BYTES = 256 * 2**20  # one image's pixel values: a 4k x 4k float32 RGB tensor is 192 MiB


class Tensor(Struct, kw_only=True, forbid_unknown_fields=True):
    """A dense array: `data` holds prod(shape) elements of `dtype`, little-endian, row-major (C order)."""

    data: bytes
    dtype: TensorDtype
    shape: list[int]


def pack_tensor(array: np.ndarray) -> Tensor:
    """A numpy array as a Tensor (float64 is sent as float32)."""
    a = np.asarray(array)
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    name = str(a.dtype)
    if name not in ("float32", "float16", "uint8"):
        raise ValueError(f"no wire dtype for {name}")
    return Tensor(data=np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes(), dtype=name,
                  shape=[int(n) for n in a.shape])


def unpack_tensor(t: Tensor) -> np.ndarray:
    """The array a Tensor holds; ValueError when its bytes do not match its shape or are too many."""
    if any(n < 0 for n in t.shape) or len(t.shape) > 8:
        raise ValueError(f"tensor shape {t.shape} is not a shape")
    dtype = np.dtype(t.dtype).newbyteorder("<")
    count = int(np.prod(t.shape, dtype=np.int64)) if t.shape else 1
    if len(t.data) > MAX_TENSOR_BYTES or count * dtype.itemsize != len(t.data):
        raise ValueError(f"tensor of shape {t.shape} and dtype {t.dtype} cannot hold {len(t.data)} bytes")
    return np.frombuffer(t.data, dtype=dtype).reshape(t.shape)
