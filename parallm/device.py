"""What MLX computes on and how much memory that device has: the queries the engine's memory rules
(engine/memory.py) and the model loader's dtype policy (models/dtype.py) both ask, below both so
neither imports the other. Each answers None (or "cpu") off its backend; tests stub them."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["compute_device", "cuda_memory", "metal_working_set"]


def compute_device() -> str:
    """The backend MLX computes on: "cpu" (MLX's CPU device), "cuda" or "metal" (config.ComputeDevice),
    which decides the engine's unset settings (config.resolve_engine_config)."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


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
