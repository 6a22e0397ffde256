"""What MLX computes on and how much memory that device has: the queries the engine's memory rules
(engine/memory.py) and the model loader's dtype policy (models/dtype.py) both ask, below both so
neither imports the other. Each answers None (or "cpu") off its backend; tests stub them."""

from __future__ import annotations

import os

import mlx.core as mx

__all__ = ["compute_device", "cuda_memory", "exact_float32", "metal_working_set"]


def compute_device() -> str:
    """The backend MLX computes on: "cpu" (MLX's CPU device), "cuda" or "metal" (config.ComputeDevice),
    which decides the engine's unset settings (config.resolve_engine_config)."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def exact_float32() -> bool:
    """Whether float32 matmuls round as float32 here: not on CUDA, where MLX uses TF32 (a 10-bit mantissa)
    unless MLX_ENABLE_TF32=0. The engine's start-up checks of a float32 model judge its logits by the
    16-bit tolerance where not (a 28-layer float32 llama's batched rows differ by 1.1 % there)."""
    return compute_device() != "cuda" or os.environ.get("MLX_ENABLE_TF32", "1") == "0"


def metal_working_set() -> int | None:
    """Metal's recommended working-set size in bytes where MLX computes on Apple silicon's GPU
    (unified memory), else None."""
    try:
        if mx.default_device() != mx.gpu or not mx.metal.is_available():
            return None
        return int(mx.device_info()["max_recommended_working_set_size"])
    except Exception:  # noqa: BLE001 - backend specific
        return None


def cuda_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the CUDA device MLX computes on, else None."""
    try:
        if mx.default_device() != mx.gpu or not mx.cuda.is_available():
            return None
        info = mx.device_info()
        return int(info["free_memory"]), int(info["total_memory"])
    except Exception:  # noqa: BLE001 - backend specific
        return None
