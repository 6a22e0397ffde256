"""How much memory the KV gets when `engine.kv_budget_mb` is unset, and how the engine keeps MLX's
buffer cache from running a GPU out of memory."""

from __future__ import annotations

import logging
import os
from typing import Callable, TypeVar

import mlx.core as mx

log = logging.getLogger("parallm.engine")
T = TypeVar("T")
GPU_BUFFER_CACHE_BYTES = 2 << 30
OUT_OF_MEMORY = ("out of memory", "Insufficient Memory", "OutOfMemory")

AUTO_BUDGET_FRACTION = 0.35
AUTO_BUDGET_CAP = 8 << 30


def auto_kv_budget_bytes() -> int:
    """A share of the memory available now (the model is already loaded), capped."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not avail:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        except (ValueError, OSError):  # pragma: no cover
            avail = 8 << 30
    try:
        if mx.metal.is_available():
            avail = min(avail, int(mx.metal.device_info()["max_recommended_working_set_size"]))
    except Exception:  # pragma: no cover - backend specific
        pass
    return max(64 << 20, min(int(avail * AUTO_BUDGET_FRACTION), AUTO_BUDGET_CAP))


def limit_buffer_cache(on_cpu: bool) -> None:
    """On a GPU, cap the memory MLX keeps in its cache of freed buffers (GPU_BUFFER_CACHE_BYTES).

    Unbounded, the cache kept every KV buffer a resize left behind (GBs at 256 rows, rarely reused at
    another size) beside the live ones; with other processes on the device, a resize at c=256 then
    failed in cudaMallocAsync and took the engine down with 256 requests (issue 24). A step's
    transient buffers (activations, logits) fit well within the cap, so they are still reused."""
    if not on_cpu:
        mx.set_cache_limit(GPU_BUFFER_CACHE_BYTES)


def is_out_of_memory(exc: BaseException) -> bool:
    """An MLX allocation failure (CUDA's cudaMalloc*, Metal's insufficient memory)."""
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in OUT_OF_MEMORY)


def retry_out_of_memory(allocate: Callable[[], T]) -> T:
    """`allocate()`, once more after MLX's buffer cache went back to the device if it ran out of
    memory. `allocate` must change nothing before its allocations are evaluated."""
    try:
        return allocate()
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        cached = mx.get_cache_memory()
        mx.clear_cache()
        log.warning("out of device memory (%s); retrying with MLX's buffer cache (%.0f MiB) freed", exc,
                    cached / (1 << 20))
        return allocate()
