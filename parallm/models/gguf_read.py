"""Reading a GGUF file: its metadata, and its tensors as MLX arrays named the way `mx.load` names them.

Tensor types, and what they become:
- F32, F16, BF16: the same float type.
- Q4_0, Q4_1, Q8_0: MLX affine quantization, 4 or 8 bits, group size 32 (`<name>.weight` packed
  into uint32, `<name>.scales` and `<name>.biases` in float16). These are exact re-encodings: the
  GGUF blocks are affine with 32 values per block.
- every other type the `gguf` package can decode (Q2_K..Q6_K, Q5_0, Q5_1, IQ*, ...): dequantized
  to float16 (float32 if a value would overflow float16). MLX has no kernels for those layouts.

When a file holds only MLX-native types (F32/F16/Q4_0/Q4_1/Q8_0, e.g. the embedded model), the
tensors come from `mx.load`, which decodes them in C++ in a fraction of a second. Otherwise every
tensor is decoded here with numpy: `mx.load` turns BF16 into float16 (overflowing large values),
decodes K-quants itself, and rejects the whole file on one type it lacks (Q5_0, IQ*).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .errors import ModelLoadError

MLX_NATIVE = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})
_FLOAT16_MAX = 65504.0


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensor_types: dict[str, str]            # GGUF tensor name -> GGML type name ("Q4_1")
    tensor_shapes: dict[str, tuple[int, ...]]  # logical shape, numpy order (rows first)
    reader: Any                             # gguf.GGUFReader (memory-maps the file)


def _value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, float):
        value = float(str(np.float32(value)))  # GGUF stores float32: 1e-05, not 9.99999974e-06
    return value


def open_gguf(path: Path) -> GGUFFile:
    """Parse the header: metadata and the tensor directory (tensor data stays on disk)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct.error, ... on a bad file
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from None
    metadata = {key: _value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    return GGUFFile(path=path, metadata=metadata, tensor_types=types, tensor_shapes=shapes, reader=reader)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned `bits`-bit values (rows, n) into uint32 words, first value in the lowest bits."""
    per_word = 32 // bits
    q = q.astype(np.uint32).reshape(q.shape[0], -1, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(q << shifts, axis=-1)


def _affine_blocks(type_name: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(packed weight, scales, biases, bits) for Q4_0 / Q4_1 / Q8_0 blocks (rows, bytes)."""
    rows = data.shape[0]
    if type_name == "Q8_0":  # f16 d, then 32 x int8: x = d * q
        blocks = data.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _pack(q.reshape(rows, -1), 8), d, d * np.float16(-128), 8
    if type_name == "Q4_0":  # f16 d, then 16 bytes of nibbles: x = d * (q - 8)
        blocks = data.reshape(rows, -1, 18)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        qs, bias = blocks[..., 2:], d * np.float16(-8)
    elif type_name == "Q4_1":  # f16 d, f16 m, then 16 bytes of nibbles: x = d * q + m
        blocks = data.reshape(rows, -1, 20)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:]
    else:
        raise ValueError(type_name)
    # Element j of a block is the low nibble of byte j; element j + 16 the high nibble.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return _pack(q.reshape(rows, -1), 4), d, bias, 4


def _decode(name: str, type_name: str, tensor: Any) -> dict[str, mx.array]:
    import gguf.quants

    data = np.asarray(tensor.data)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    base = name.rsplit(".", 1)[0]
    if type_name in ("F32", "F16"):
        return {name: mx.array(data.reshape(shape))}
    if type_name == "BF16":
        return {name: mx.array(data.view(np.uint16).reshape(shape)).view(mx.bfloat16)}
    if type_name in ("Q4_0", "Q4_1", "Q8_0") and name.endswith(".weight") and len(shape) == 2:
        weight, scales, biases, _ = _affine_blocks(type_name, data.reshape(shape[0], -1))
        return {name: mx.array(weight), f"{base}.scales": mx.array(scales), f"{base}.biases": mx.array(biases)}
    try:
        values = gguf.quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {name} has GGML type {type_name}, which neither MLX nor the installed gguf "
            f"package ({getattr(gguf, '__version__', '?')}) can decode; re-quantize the model to "
            "Q8_0, Q4_0, Q4_1 or a K-quant, or use its original weights") from None
    values = values.reshape(shape)
    keep_f32 = values.size and float(np.abs(values).max()) > _FLOAT16_MAX
    return {name: mx.array(values if keep_f32 else values.astype(np.float16))}


def load_tensors(gf: GGUFFile, progress: Callable[[str], None] | None = None) -> dict[str, mx.array]:
    """Every tensor, keyed like `mx.load` keys them (`x.weight`, plus `x.scales`/`x.biases` when quantized)."""
    if set(gf.tensor_types.values()) <= MLX_NATIVE:
        try:
            arrays = mx.load(str(gf.path))
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"MLX could not read {gf.path}: {exc}") from None
        if progress is not None:
            for name in gf.tensor_types:
                progress(name)
        return arrays
    out: dict[str, mx.array] = {}
    for tensor in gf.reader.tensors:
        out.update(_decode(tensor.name, tensor.tensor_type.name, tensor))
        if progress is not None:
            progress(tensor.name)
    return out
