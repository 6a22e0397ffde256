"""Reading adapters: mlx-lm's format and PEFT's, normalised to one in-memory form.

- mlx-lm (written by `mlx_lm.lora`): `adapters.safetensors` + `adapter_config.json` with
  `fine_tune_type` (lora | dora), `num_layers`, `lora_parameters` {rank, scale, dropout, keys}.
  Tensors `<module>.lora_a` [in, r], `<module>.lora_b` [r, out] and, for DoRA, `<module>.m` [out];
  on a MoE model's expert projections (LoRASwitchLinear) `lora_a` [E, r, in] and `lora_b`
  [E, out, r], held here as a [E, in, r] and b [E, r, out].
- PEFT: `adapter_model.safetensors` + `adapter_config.json` with `r`, `lora_alpha`,
  `target_modules`, `use_rslora`. Tensors `base_model.model.<module>.lora_A.weight` [r, in] and
  `...lora_B.weight` [out, r]: transposed here, and the scale is lora_alpha / r
  (lora_alpha / sqrt(r) with rsLoRA).

`parse()` checks the adapter on its own (names, pairs, ranks, dtypes); `parallm.adapters.lora`
checks it against the base model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import mlx.core as mx

from .errors import AdapterError
from parallm.files import UnsafeFile, read_regular

from .safetensors_io import Target, read_bytes

Format = Literal["auto", "mlx", "peft"]
FLOATS = (mx.float32, mx.float16, mx.bfloat16)
MLX_FILE, PEFT_FILE, CONFIG_FILE = "adapters.safetensors", "adapter_model.safetensors", "adapter_config.json"


@dataclass(slots=True)
class ModuleLoRA:
    """The low-rank update of one linear layer: y += scale * (x @ a) @ b (DoRA: then * magnitude/norm)."""

    a: mx.array  # [in, r]; an expert layer's [E, in, r]
    b: mx.array  # [r, out]; an expert layer's [E, r, out]
    scale: float
    m: mx.array | None = None  # DoRA magnitude [out]

    @property
    def rank(self) -> int:
        return int(self.a.shape[-1])


@dataclass(slots=True)
class ParsedAdapter:
    format: Literal["mlx", "peft"]
    kind: Literal["lora", "dora"]
    modules: dict[str, ModuleLoRA]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def allowed_path(path: str, roots: Sequence[str]) -> str:
    """`path` resolved (symlinks and `..` followed) when it lies in one of `roots`; anything else is one
    and the same error, so that a client cannot tell a server path that exists from one that does not."""
    resolved = os.path.realpath(path)
    for root in roots:
        top = os.path.realpath(root)
        if resolved == top or resolved.startswith(top.rstrip(os.sep) + os.sep):
            return resolved
    raise AdapterError(f"adapter path {path!r} is not under a directory this server loads adapters from "
                       "(adapters.allowed_dirs)", status=403, code="adapter_path_not_allowed")


def read_dir(path: str | Path) -> tuple[dict[str, Any], bytes, str]:
    """(config, safetensors bytes, format) of an adapter directory."""
    p = Path(path)
    if not p.exists():
        raise AdapterError(f"adapter path {str(p)!r} does not exist on the server", status=404, code="adapter_not_found")
    if p.is_file():
        p = p.parent
    cfg_path = p / CONFIG_FILE
    if not cfg_path.exists():
        raise AdapterError(f"adapter directory {str(p)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(_read(cfg_path))
    except ValueError as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    for name, fmt in ((MLX_FILE, "mlx"), (PEFT_FILE, "peft")):
        if (p / name).exists():
            return config, _read(p / name), fmt
    if (p / "adapter_model.bin").is_file():
        raise AdapterError(f"{p}/adapter_model.bin is a pickled PyTorch file; save the adapter as safetensors")
    raise AdapterError(f"adapter directory {str(p)!r} has neither {MLX_FILE} nor {PEFT_FILE}")


def _read(path: Path) -> bytes:
    """A file of an adapter directory: a regular file only (a FIFO there blocked the engine until it was
    restarted), read with a timeout (parallm.files)."""
    try:
        return read_regular(path)
    except UnsafeFile as exc:
        raise AdapterError(f"cannot read the adapter: {exc}", code="invalid_adapter_file") from None
    except OSError as exc:
        raise AdapterError(f"cannot read the adapter's {path.name} ({type(exc).__name__})",
                           code="invalid_adapter_file") from None


def detect(config: dict[str, Any], names: list[str]) -> Literal["mlx", "peft"]:
    if "fine_tune_type" in config or "lora_parameters" in config:
        return "mlx"
    if "peft_type" in config or "lora_alpha" in config or "target_modules" in config:
        return "peft"
    if any(n.endswith(".lora_a") for n in names):
        return "mlx"
    if any(".lora_A." in n for n in names):
        return "peft"
    raise AdapterError("cannot tell the adapter format: the config has neither mlx-lm's lora_parameters nor "
                       "PEFT's lora_alpha, and no tensor is named like lora_a / lora_A")


def parse(config: dict[str, Any], weights: bytes | dict[str, mx.array], fmt: Format = "auto",
          dtype: mx.Dtype | None = None) -> ParsedAdapter:
    """The adapter on its own, checked; AdapterError when it is not one.

    Weights given as bytes have their lora_a / lora_b read in `dtype` when given (DoRA's `m`
    keeps its own): one cast per stored dtype instead of one per tensor.
    """
    if isinstance(weights, (bytes, bytearray, memoryview)):
        tensors, nonfinite = read_bytes(weights, None if dtype is None else _lora_weights_in(dtype))
    else:
        tensors, nonfinite = dict(weights), None
    if not tensors:
        raise AdapterError("the adapter has no tensors")
    for name, t in tensors.items():
        if not isinstance(t, mx.array):
            raise AdapterError(f"tensor {name!r} is a {type(t).__name__}, not an mx.array")
        if t.dtype not in FLOATS:
            raise AdapterError(f"tensor {name!r} has dtype {str(t.dtype).rsplit('.', 1)[-1]}; adapter weights must be float32, float16 "
                               "or bfloat16")
    if fmt == "auto":
        fmt = detect(config, list(tensors))
    parsed = _parse_mlx(config, tensors) if fmt == "mlx" else _parse_peft(config, tensors)
    _reject_nonfinite(nonfinite_names(tensors) if nonfinite is None else nonfinite)
    return parsed


def _lora_weights_in(dtype: mx.Dtype) -> Target:
    return lambda name: None if name.endswith(".m") else dtype


def nonfinite_names(tensors: dict[str, mx.array]) -> list[str]:
    """Names of the tensors holding NaN or inf, in order; one evaluation and one sync for all."""
    names = list(tensors)
    if not names:
        return []
    flags = mx.stack([mx.all(mx.isfinite(tensors[n])) for n in names])
    return [n for n, ok in zip(names, flags.tolist()) if not ok]


def _reject_nonfinite(bad: list[str]) -> None:
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise AdapterError(f"tensor {bad[0]!r}{''.join(', ' + repr(b) for b in bad[1:3])}{more} holds NaN or "
                           "infinite values")


def _number(cfg: dict[str, Any], key: str, where: str) -> float:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"{where} needs a finite number '{key}' (got {value!r})")
    return float(value)


def _parse_mlx(config: dict[str, Any], tensors: dict[str, mx.array]) -> ParsedAdapter:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"fine_tune_type {kind!r} is not an adapter (only lora and dora are served; a "
                           "'full' fine-tune is a new model: serve it as one)")
    lp = config.get("lora_parameters")
    if not isinstance(lp, dict):
        raise AdapterError("adapter_config.json has no lora_parameters map (mlx-lm format)")
    scale = _number(lp, "scale", "lora_parameters")
    rank = int(_number(lp, "rank", "lora_parameters"))
    groups: dict[str, dict[str, mx.array]] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m") or not module:
            raise AdapterError(f"tensor {name!r} is not a LoRA tensor (expected <module>.lora_a, .lora_b or .m)")
        groups.setdefault(module, {})[leaf] = t
    modules = {}
    for module, g in sorted(groups.items()):
        if "lora_a" not in g or "lora_b" not in g:
            raise AdapterError(f"module {module!r} has {sorted(g)} but needs both lora_a and lora_b")
        a, b = g["lora_a"], g["lora_b"]
        experts = a.ndim == 3 or b.ndim == 3
        if experts and (kind == "dora" or "m" in g):
            raise AdapterError(f"module {module!r}: DoRA on expert (switch) layers is not served (mlx-lm has none "
                               "either)")
        if ("m" in g) != (kind == "dora"):
            raise AdapterError(f"module {module!r}: DoRA magnitude 'm' {'missing' if kind == 'dora' else 'present'} "
                               f"but fine_tune_type is {kind!r}")
        if experts:
            a, b = _experts_lora(module, a, b)
        elif a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(f"module {module!r}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are not "
                               "[in, r] and [r, out]")
        if a.shape[-1] != rank:
            raise AdapterError(f"module {module!r}: rank {a.shape[-1]} differs from lora_parameters.rank {rank}")
        m = g.get("m")
        if m is not None and m.shape != (b.shape[1],):
            raise AdapterError(f"module {module!r}: DoRA magnitude has shape {tuple(m.shape)}, expected ({b.shape[1]},)")
        modules[module] = ModuleLoRA(a=a, b=b, scale=scale, m=m)
    keys = lp.get("keys")
    if keys:
        # a key names a module inside a layer: what follows the layer list's index (layers.3., h.3., blocks.3.)
        stray = sorted({_LAYER_INDEX.split(m, maxsplit=1)[-1] for m in modules} - set(keys))
        if stray:
            raise AdapterError(f"tensors target {stray}, which lora_parameters.keys {sorted(keys)} does not list")
    return ParsedAdapter(format="mlx", kind=kind, modules=modules, config=config)


def _experts_lora(module: str, a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's LoRASwitchLinear tensors (lora_a [E, r, in], lora_b [E, out, r]) as [E, in, r], [E, r, out]."""
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        raise AdapterError(f"module {module!r}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are not an expert "
                           "layer's [experts, r, in] and [experts, out, r]")
    return a.swapaxes(1, 2), b.swapaxes(1, 2)


_LAYER_INDEX = re.compile(r"(?:^|\.)\d+\.")
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


def _parse_peft(config: dict[str, Any], tensors: dict[str, mx.array]) -> ParsedAdapter:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not served (only LORA)")
    if config.get("use_dora"):
        raise AdapterError("PEFT DoRA adapters are not supported; convert to mlx-lm's format (fine_tune_type dora)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError("PEFT rank_pattern / alpha_pattern are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"PEFT modules_to_save {config['modules_to_save']} are full weights, not an adapter; "
                           "not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"PEFT bias={config.get('bias')!r} is not supported (only 'none')")
    r = _number(config, "r", "a PEFT adapter_config.json")
    alpha = _number(config, "lora_alpha", "a PEFT adapter_config.json")
    if r <= 0:
        raise AdapterError(f"PEFT r must be positive (got {r})")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    groups: dict[str, dict[str, mx.array]] = {}
    for name, t in tensors.items():
        match = _PEFT_KEY.match(name)
        if match is None:
            raise AdapterError(f"tensor {name!r} is not a PEFT LoRA tensor (expected ...<module>.lora_A.weight / "
                               "lora_B.weight)")
        groups.setdefault(match["module"], {})[match["which"]] = t
    targets = config.get("target_modules")  # a list of module names, or one regex (PEFT's rule)
    modules = {}
    for module, g in sorted(groups.items()):
        if set(g) != {"A", "B"}:
            raise AdapterError(f"module {module!r} needs both lora_A and lora_B")
        A, B = g["A"], g["B"]
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
            raise AdapterError(f"module {module!r}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are not "
                               "[r, in] and [out, r]")
        if A.shape[0] != int(r):
            raise AdapterError(f"module {module!r}: rank {A.shape[0]} differs from r={int(r)} in the config")
        if isinstance(targets, str) and not re.fullmatch(targets, module) or \
                isinstance(targets, list) and targets and module.rsplit(".", 1)[-1] not in targets:
            raise AdapterError(f"module {module!r} is not among target_modules {targets}")
        modules[module] = ModuleLoRA(a=A.T, b=B.T, scale=scale)
    return ParsedAdapter(format="peft", kind="lora", modules=modules, config=config)
