"""Model types refused before anything is loaded, with the reason.

The model loader (parallm/models/loader.py) refuses them before reading weights; the engine's
compatibility check (parallm/engine/compat.py, which re-exports these) refuses them too, with what only
a loaded model tells.
"""

from __future__ import annotations

REFUSED_MODEL_TYPES: dict[str, str] = {
    "plamo3": "mlx-lm's plamo3 masks a window of window+1 keys over a window-sized rotating cache, so its "
              "own full prefill and step-by-step decoding disagree; no batched engine can match it",
    "phi3small": "mlx-lm's phi3small block-sparse layers add a boolean mask to the scores, so its prefill "
                 "sees future tokens; its outputs are not a causal model's",
    "deepseek_v41": "deepseek_v41 keeps compressed token groups in its own LayerCache (window, pending "
                    "tokens), which the engine's per-row KV rows cannot stand in for",
    "bitnet": "bitnet's ternary layers need Metal kernels (mx.fast.metal_kernel)",
    "muse_spark": "muse_spark needs Metal kernels (mx.fast.metal_kernel)",
}


def refusal_for_type(model_type: str) -> str | None:
    """Why a model type is refused before loading, or None."""
    return REFUSED_MODEL_TYPES.get(model_type)
