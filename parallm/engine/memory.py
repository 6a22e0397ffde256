"""Which backend MLX computes on, how much memory the KV gets when `engine.kv_budget_mb` is unset,
and how the engine keeps MLX's buffer cache from running a GPU out of memory."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Callable, TypeVar

import mlx.core as mx

from parallm.device import cuda_memory, metal_working_set

if TYPE_CHECKING:
    from parallm.config import EngineConfig

log = logging.getLogger("parallm.engine")
T = TypeVar("T")
OUT_OF_MEMORY = ("out of memory", "Insufficient Memory", "OutOfMemory")

AUTO_BUDGET_FRACTION = 0.35
AUTO_BUDGET_CAP = 8 << 30


# Apple silicon: the share of Metal's recommended working set left after the weights that the KV
# gets (the rest: activations, logits, MLX's buffer cache)
METAL_KV_FRACTION = 0.7
# a CUDA GPU: the share of the device memory free once the weights are loaded that the KV gets
CUDA_KV_FRACTION = 0.5


def cuda_free_after_weights(weight_bytes: int) -> int | None:
    """The CUDA device's free memory, less the weights if they are not resident yet; None off CUDA."""
    cuda = cuda_memory()
    return None if cuda is None else min(cuda[0], cuda[1] - weight_bytes)


def set_wired_limit() -> int | None:
    """Wire Metal's recommended working set, as mlx-lm does while it generates, so the weights and
    KV stay resident instead of being paged out between steps; the size set, or None off Metal."""
    size = metal_working_set()
    if size is None:
        return None
    mx.set_wired_limit(size)
    log.info("Metal wired memory limit set to the recommended working set, %.1f GiB", size / (1 << 30))
    return size


def auto_kv_budget_bytes(weight_bytes: int = 0) -> int:
    """The KV budget when engine.kv_budget_mb is unset. On Apple silicon: a share of Metal's
    recommended working set minus the weights (`weight_bytes`). On a CUDA GPU: a share of the
    device memory free now (less the weights if they are not resident yet). Elsewhere: a share of
    the memory available now (the model is already loaded; /proc/meminfo on Linux), capped.

    The CPU rule (at most 8 GiB) was the GPU's too: on the H200 it held the Qwen3.5-4B-like hybrid
    to 83 rows of recurrent state (49 MiB each, half the budget) against --engine.max-num-seqs 256,
    so at 256 streams most requests queued for a row (TTFT p50 18.5 s against BatchGenerator's 8.9
    s, perf/results/serving-qwen3.5-4b-hybrid-h200.md), and the MoE's 256 rows x 256 tokens filled
    its live slots to within 5."""
    working_set = metal_working_set()
    if working_set is not None:
        return max(64 << 20, int((working_set - weight_bytes) * METAL_KV_FRACTION))
    free = cuda_free_after_weights(weight_bytes)
    if free is not None:
        return max(64 << 20, int(free * CUDA_KV_FRACTION))
    avail = 0
    if sys.platform.startswith("linux"):
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
    return max(64 << 20, min(int(avail * AUTO_BUDGET_FRACTION), AUTO_BUDGET_CAP))


STATE_BUDGET_SHARE = 0.5  # recurrent state may take this much of the KV budget; the rest holds KV


def fit_state_rows(budget_bytes: int, state_bytes_per_row: int, max_num_seqs: int) -> int:
    """How many rows of recurrent state (hybrid/SSM models: tens of MiB per row, held for every
    running sequence whatever its length) the engine can hold beside the KV: at most
    STATE_BUDGET_SHARE of the budget. Raises ValueError when not even one row fits, naming the sizes.
    Without this, 256 rows of a Qwen3.5-4B-like model (49 MiB each) took the whole 8 GiB budget and
    every request was refused for want of KV (found on the H200)."""
    fits = int(budget_bytes * STATE_BUDGET_SHARE) // max(1, state_bytes_per_row)
    if fits < 1:
        raise ValueError(f"one sequence's recurrent state ({state_bytes_per_row / (1 << 20):.1f} MiB) does not fit in "
                         f"{STATE_BUDGET_SHARE:.0%} of the KV budget ({budget_bytes / (1 << 20):.0f} MiB); raise "
                         "--engine.kv-budget-mb")
    if fits < max_num_seqs:
        log.warning("engine.max_num_seqs %d -> %d: a row of recurrent state takes %.1f MiB and the state may "
                    "use half of the %.0f MiB KV budget (raise --engine.kv-budget-mb for more rows)",
                    max_num_seqs, fits, state_bytes_per_row / (1 << 20), budget_bytes / (1 << 20))
    return min(max_num_seqs, fits)


def store_blocks(budget_bytes: int, bytes_per_token: int, state_bytes_per_row: int, settings: EngineConfig) -> int:
    """Blocks of the one KV block store (the live sequences and the prefix cache alike, cache.LiveKV):
    the KV budget left beside the recurrent state (`state_bytes_per_row` for each of
    `settings.max_num_seqs` rows; 0 without any) in blocks of `settings.block_size` tokens."""
    state_bytes = state_bytes_per_row * settings.max_num_seqs
    return max(0, budget_bytes - state_bytes) // bytes_per_token // settings.block_size


def weight_bytes(model) -> int:
    """Bytes of the model's parameters."""
    from mlx.utils import tree_flatten

    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def limit_buffer_cache(limit_mb: float | None) -> None:
    """Cap the memory MLX keeps in its cache of freed buffers (engine.buffer_cache_mb); unset keeps
    MLX's own limit, which on a GPU is most of its memory: alone on the device that costs nothing,
    beside other processes it can run the device out (a resize that does is retried with the cache
    freed, see retry_out_of_memory). The H100 c=256 runs ran at half the throughput with a 2 GiB cap
    (perf/results/stress-waves-llama-3.2-3b-h100.json), so none is set by default."""
    if limit_mb is not None:
        mx.set_cache_limit(int(limit_mb * (1 << 20)))


CUDA_CACHE_SHARE = 0.8  # of the device memory free after the weights and the KV budget
CUDA_CACHE_FLOOR = 4 << 30


def bound_cuda_cache(kv_budget_bytes: int, weight_bytes: int = 0) -> int | None:
    """On a CUDA GPU with engine.buffer_cache_mb unset: cap MLX's buffer cache at a share of the
    device memory left free once the weights are loaded and the KV budget is set aside; the cap in
    bytes, or None where nothing was set (not CUDA, or less than CUDA_CACHE_FLOOR would be left).

    MLX's own cap is 95% of the device's memory, which it assumes is all its own: beside another
    process holding memory (the serving benchmark's in-process BatchGenerator keeps its copy of the
    weights, 17 GB for the Qwen3-30B-A3B shape), a cache of dead buffers from earlier runs' shapes
    runs the device out, and the allocation that finds it out fails (an engine step) or is
    retried after freeing the whole cache at once (a resize, retry_out_of_memory), a stall. A cap
    makes MLX return the oldest buffers a few at a time as it goes; it is tens of GB on an
    H100/H200, far from the 2 GiB cap that halved the H100's c=256 throughput."""
    free = cuda_free_after_weights(weight_bytes)
    if free is None:
        return None
    limit = int((free - kv_budget_bytes) * CUDA_CACHE_SHARE)
    if limit < CUDA_CACHE_FLOOR:
        return None
    mx.set_cache_limit(limit)
    log.info("MLX buffer cache capped at %.1f GiB (%.0f%% of the device memory left after the weights and the "
             "KV budget)", limit / (1 << 30), 100 * CUDA_CACHE_SHARE)
    return limit


def is_out_of_memory(exc: BaseException) -> bool:
    """An MLX allocation failure (CUDA's cudaMalloc*, Metal's insufficient memory)."""
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in OUT_OF_MEMORY)


_oom_retries = 0


def oom_retries() -> int:
    """How many allocations `retry_out_of_memory` retried in this process."""
    return _oom_retries


def retry_out_of_memory(allocate: Callable[[], T]) -> T:
    """`allocate()`, once more after MLX's buffer cache went back to the device if it ran out of
    memory. `allocate` must change nothing before its allocations are evaluated."""
    global _oom_retries
    try:
        return allocate()
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        _oom_retries += 1
        cached = mx.get_cache_memory()
        mx.clear_cache()
        log.warning("out of device memory (%s); retrying with MLX's buffer cache (%.0f MiB) freed", exc,
                    cached / (1 << 20))
        return allocate()
