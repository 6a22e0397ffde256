"""How much memory the KV gets when `engine.kv_budget_mb` is unset."""

from __future__ import annotations

import os

import mlx.core as mx

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
