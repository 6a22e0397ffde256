"""GGUF file -> MLX model directory (config.json, model.safetensors, tokenizer and generation files).

Weights are stored as they come: GGUF's Q4_0/Q4_1/Q8_0 stay MLX-quantized (4/8 bits, group 32,
declared per module in config["quantization"]), float tensors keep their type, and only types
MLX cannot compute with are dequantized (see gguf_read). The dtype policy is applied at load time.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf_arch import build_config, get_arch, map_tensors
from .gguf_read import load_tensors, open_gguf
from .gguf_tokenizer import write_tokenizer_files

log = logging.getLogger(__name__)


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's quantization section: the commonest (bits, group) as default, other modules listed."""
    found: dict[str, tuple[int, int]] = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        packed = weights[f"{module}.weight"].shape[-1]
        bits = 32 * packed // (scales.shape[-1] * 32)  # every GGUF block type MLX reads has 32 values
        found[module] = (bits, 32)
    if not found:
        return None
    (bits, group), _ = Counter(found.values()).most_common(1)[0]
    section: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
    for module, (b, g) in sorted(found.items()):
        if (b, g) != (bits, group):
            section[module] = {"group_size": g, "bits": b, "mode": "affine"}
    return section


def convert_gguf(path: Path, out: Path, *, progress: bool = True, name: str = "") -> None:
    """Write the MLX model directory for the GGUF file `path` into the (empty) directory `out`."""
    from tqdm import tqdm

    gf = open_gguf(path)
    meta = gf.metadata
    get_arch(meta.get("general.architecture", "?"))  # refuse unsupported files before any heavy work
    # The tokenizer first, too: it is cheap and refuses files whose ids it could not reproduce.
    max_len = int(meta.get(f"{meta['general.architecture']}.context_length") or 0)
    eos_ids = write_tokenizer_files(meta, out, model_max_length=max_len)
    label = name or path.name
    with tqdm(total=len(gf.tensor_types) * 2, desc=f"Converting {label} to MLX", unit="tensor",
              disable=not progress, leave=False) as bar:
        arrays = load_tensors(gf, progress=lambda _: bar.update())
        config = build_config(meta, gf.tensor_shapes, arrays)
        weights = map_tensors(meta, arrays)
        quantization = _quantization(weights)
        if quantization is not None:
            config["quantization"] = quantization
            config["quantization_config"] = quantization
        bar.update(len(gf.tensor_types))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    ids = dict.fromkeys(eos_ids)
    config["eos_token_id"] = list(ids) if len(ids) > 1 else next(iter(ids), None)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    generation = {"eos_token_id": config["eos_token_id"]}
    if bos is not None:
        generation["bos_token_id"] = int(bos)
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        generation["pad_token_id"] = int(pad)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "parallm_source.json").write_text(json.dumps(
        {"gguf": str(path), "size": path.stat().st_size, "name": label}, indent=2) + "\n")
    log.info("converted %s (%s) into %s", path, config["model_type"], out)
