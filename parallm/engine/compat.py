"""Which mlx-lm models the engine drives, found by probing the model itself rather than an allow-list.

The engine hands unmodified mlx-lm models its own per-slot cache views (pass_view.RowsView). A slot
is an entry of `model.make_cache()` (not of `model.layers`: a layer may own no cache, or run
twice with two caches, as nanbeige with `num_loops: 2` does). `check_model` refuses, with a
message naming the reason, what the views cannot serve:

- a model type in REFUSED_MODEL_TYPES (known before loading: mlx-lm itself disagrees between a
  full prefill and step-by-step decoding, or the model needs a cache the views cannot stand in for);
- a slot whose cache is neither an attention KV cache nor recurrent state (`ArraysCache`, served
  by per-row state views, parallm.engine.state) or a cache a family adapter stands in for
  (parallm.engine.families: llama4's chunked attention);
- a model whose one-token probe forward fails on the views' protocol, or uses a slot more or less
  than once;
- dynamic NTK RoPE (its frequencies depend on each sequence's length);
- a model whose batched rows (two prompts of different lengths in one padded pass, then one decode
  pass) do not give the logits of each prompt run alone through its own mlx-lm caches: the check
  that keeps a model that reads per-row positions wrongly from serving silently wrong tokens (and
  a recurrent model whose scan ignores a padded row's length).

docs/models.md's support matrix is generated from REFUSED_MODEL_TYPES and the families probed by
tests (parallm.engine.matrix).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..device import exact_float32
from ..models.refused import REFUSED_MODEL_TYPES, refusal_for_type  # noqa: F401 - this module's face too
from .cache import LayerShape, LiveKV
from .pass_view import PassContext
from .families import KV_STAND_INS, adapt
from .kv_format import KVFormat
from .state import ListView, SlotLayout, StateShape

# Attention written by hand with the GQA heads split into their own axis, so the mask needs an
# extra axis: [B, 1, 1, L, T] broadcasts against [B, kv_heads, repeats, L, T] scores.
MASK_5D = ("gemma2",)


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_type: str
    shapes: list[LayerShape]  # one per KV cache slot (an entry of model.make_cache())
    dtype: mx.Dtype
    mask5d: bool
    layout: SlotLayout | None = None  # which slots hold recurrent state (None: all KV)
    prefill_alone: bool = False  # a recurrent scan that ignores a padded row's length: one row per prefill pass

    @property
    def has_state(self) -> bool:
        return self.layout is not None and bool(self.layout.states)

    @property
    def kv_bytes_per_token(self) -> int:
        return max(1, sum(s.elems_per_token for s in self.shapes) * self.dtype.size)

    @property
    def state_bytes_per_row(self) -> int:
        """Bytes of one row's recurrent state (0: the model has none)."""
        return self.layout.state_bytes_per_row if self.has_state else 0


def model_type_of(model: nn.Module) -> str:
    mt = getattr(model, "model_type", None)
    if mt is None and hasattr(model, "args"):
        mt = getattr(model.args, "model_type", None)
    return str(mt or type(model).__module__.rsplit(".", 1)[-1])


def cache_slots(model: nn.Module) -> list:
    """The model's own per-slot caches, as mlx-lm builds them (make_prompt_cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    if not hasattr(model, "make_cache") and not hasattr(model, "layers"):
        raise UnsupportedModel(f"{type(model).__name__} has neither make_cache() nor layers: not an mlx-lm "
                               "language model")
    return make_prompt_cache(model)


def check_model(model: nn.Module) -> ModelInfo:
    """Refuse what cannot work (module docstring), else describe the per-slot KV shapes."""
    mt = model_type_of(model)
    why = refusal_for_type(mt)
    if why:
        raise UnsupportedModel(f"model type {mt!r} is not served: {why}")
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    adapt(model, mt)  # families whose forward reads integer positions (parallm.engine.families)
    slots = cache_slots(model)
    kinds = [_slot_kind(c, i, mt) for i, c in enumerate(slots)]
    for _, module in model.named_modules():
        if isinstance(module, DynamicNTKScalingRoPE):
            raise UnsupportedModel("dynamic NTK RoPE scaling depends on each sequence's length and cannot "
                                   "be batched over rows of different lengths")
    shapes, dtype = probe_kv_shapes(model, kinds, mt)
    layout = None
    if any(k != "kv" for k in kinds):
        states = probe_state_shapes(model, kinds, mt)
        index = {"kv": 0, "state": 0}

        def number(kind):
            if isinstance(kind, tuple):
                return ("list", tuple(number(k) for k in kind))
            index[kind] += 1
            return (kind, index[kind] - 1)

        layout = SlotLayout(tuple(number(k) for k in kinds), tuple(states))
        dtype = dtype or mx.float32
    info = ModelInfo(model_type=mt, shapes=shapes, dtype=dtype, mask5d=mt in MASK_5D, layout=layout)
    try:
        check_batched_rows(model, info)
    except UnsupportedModel as padded_error:
        if not info.has_state:
            raise
        try:  # a recurrent scan that runs over a padded row's pad tokens: each prompt in a pass of its own
            check_batched_rows(model, info, padded=False)
        except UnsupportedModel:
            raise padded_error from None
        info = dataclasses.replace(info, prefill_alone=True)
    return info


def _slot_kind(c, i: int, model_type: str):
    """"kv", "state", or a tuple of those for a CacheList; UnsupportedModel for anything else."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    if type(c) in (KVCache, RotatingKVCache) or type(c).__name__ in KV_STAND_INS.get(model_type, ()):
        return "kv"
    if type(c) is ArraysCache:
        return "state"
    if type(c) is CacheList:
        return tuple(_slot_kind(x, i, model_type) for x in c.caches)
    raise UnsupportedModel(f"model type {model_type!r} is not served: cache slot {i} holds a {type(c).__name__} "
                           f"({_cache_kind(c)}); the engine serves attention KV caches and recurrent state")


def _cache_kind(c) -> str:
    name = type(c).__name__
    if name == "ChunkedKVCache":
        return "chunked local attention"
    if "Quantized" in name:
        return "a quantized KV cache"
    return "a cache kind the engine has no per-row view for"


class _Probe:
    """A one-row, one-token cache that records what each slot stores."""

    def __init__(self, record: list) -> None:
        self._record = record
        self.offset = mx.array([0], dtype=mx.int32)

    def __bool__(self) -> bool:
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._record.append((keys.shape, values.shape, keys.dtype))
        self._fetched = keys, values
        return keys, values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self._fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return mx.ones((1, 1, N, N), dtype=mx.bool_)

    @property
    def state(self):
        return ()

    @property
    def nbytes(self) -> int:
        return 0


def probe_state_shapes(model: nn.Module, kinds: list[str], model_type: str) -> list[StateShape]:
    """Per state slot, each entry's per-row shape and dtype, from a two-token forward through the
    model's own caches."""
    slots = cache_slots(model)
    try:
        mx.eval(model(mx.array([[1, 2]]), cache=slots))
    except Exception as e:  # noqa: BLE001
        raise UnsupportedModel(f"model type {model_type!r} is not served: its forward pass fails on its own "
                               f"caches ({type(e).__name__}: {e})") from e
    out = []

    def walk(kind, c):
        if isinstance(kind, tuple):
            for k, x in zip(kind, c.caches):
                walk(k, x)
        elif kind == "state":
            out.append(StateShape(tuple(None if a is None else (tuple(a.shape[1:]), a.dtype) for a in c.cache)))

    for kind, c in zip(kinds, slots):
        walk(kind, c)
    return out


def probe_kv_shapes(model: nn.Module, kinds: list[str], model_type: str = "model") -> tuple[list[LayerShape], mx.Dtype]:
    """One-token forward: KV slots through recording probes (each must store one token's K/V
    once), state slots through the model's own caches."""
    own = cache_slots(model)
    records: list[list] = []

    def probe(kind, c):
        if isinstance(kind, tuple):
            return ListView([probe(k, x) for k, x in zip(kind, c.caches)])
        if kind == "kv":
            records.append([])
            return _Probe(records[-1])
        return c

    probes = [probe(k, c) for k, c in zip(kinds, own)]
    try:
        mx.eval(model(mx.array([[0]]), cache=probes))
    except Exception as e:
        raise UnsupportedModel(f"model type {model_type!r} is not served: its forward pass does not run on the "
                               f"engine's cache views ({type(e).__name__}: {e})") from e
    shapes = []
    dtype = None
    for i, r in enumerate(records):
        if len(r) != 1:
            raise UnsupportedModel(f"cache slot {i} was used {len(r)} times in one forward pass; the engine "
                                   "needs exactly one KV update per slot")
        (kb, kh, kl, kd), (vb, vh, vl, vd), dt = r[0]
        if (kb, kl, vb, vl) != (1, 1, 1, 1):
            raise UnsupportedModel(f"cache slot {i} stored keys {r[0][0]} for one token; expected [1, heads, 1, dim]")
        if kd == 0 or vd == 0:
            raise UnsupportedModel(f"cache slot {i} stores zero-width keys or values; not served")
        shapes.append(LayerShape(kh, kd, vh, vd))
        dtype = dtype or dt
    return shapes, dtype


def _logits(out) -> mx.array:
    return out[0] if isinstance(out, tuple) else out


def _vocab_size(model: nn.Module) -> int:
    """The number of token ids the model embeds (the probes must stay inside it: MLX does not
    bounds-check an embedding lookup, so an id past the table reads other memory)."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(size) if size else 51


def _batch_noise(model: nn.Module, info: ModelInfo, prompt: list[int], nxt: int, want_prefill: mx.array,
                 want_decode: mx.array) -> float:
    """How far a batch of two copies of one prompt (equal lengths: nothing per-row to get wrong) is
    from that prompt alone: the rounding that a batched pass's other kernels bring by themselves (a
    GPU's bf16 matmul at batch 2 is not the one at batch 1; 0.15 in a 28-layer bf16 llama on an
    H200), which the padded-rows check must not read as a position error."""
    if info.dtype == mx.float32:
        return 0.0
    try:
        pre, dec = _two_row_passes(model, info, [prompt, prompt], [nxt, nxt])
    except Exception:
        return 0.0  # the padded check reports the failure with its reason
    return max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
               for got, want in ((pre[0], want_prefill), (dec[0], want_decode)))


def _two_row_passes(model: nn.Module, info: ModelInfo, prompts: list[list[int]], nxt: list[int],
                    padded: bool = True, kv_format: KVFormat | None = None) -> tuple[list[mx.array], list[mx.array]]:
    """Each row's last prefill logits and its logits for `nxt`, through the engine's views: both prompts
    in one right-padded pass (`padded`; else each in a pass of its own row), then one decode pass."""
    live = LiveKV(info.shapes, info.dtype, info.layout, kv_format)
    live.resize(2, 16)
    L = max(map(len, prompts))
    if padded:
        ctx = PassContext(0, [0, 0], L, L, mask5d=info.mask5d, lengths=list(map(len, prompts)))
        out = _logits(model(mx.array([p + [0] * (L - len(p)) for p in prompts]), cache=live.views(ctx)))
        got_prefill = [out[i, len(p) - 1] for i, p in enumerate(prompts)]
    else:
        got_prefill = []
        for i, p in enumerate(prompts):
            ctx = PassContext(i, [0], len(p), len(p), mask5d=info.mask5d)
            got_prefill.append(_logits(model(mx.array([p]), cache=live.views(ctx)))[0, -1])
            mx.eval(got_prefill[-1], live.arrays())
    mx.eval(got_prefill, live.arrays())
    offsets = [len(p) for p in prompts]
    ctx = PassContext(0, offsets, 1, max(offsets) + 1, mask5d=info.mask5d)
    out = _logits(model(mx.array([[t] for t in nxt]), cache=live.views(ctx)))
    return got_prefill, [out[i, -1] for i in range(2)]


def check_batched_rows(model: nn.Module, info: ModelInfo, *, padded: bool = True) -> None:
    """Two prompts of different lengths in one right-padded pass (`padded`; else each prompt in a
    pass of its own row), then one decode pass, through the engine's views: each row's logits must
    be those of the prompt run alone through mlx-lm's own caches (raises UnsupportedModel naming
    the difference otherwise)."""
    ids = max(1, min(50, _vocab_size(model) - 1))  # token ids 1..ids exist in any vocabulary
    prompts = [[(7 + 13 * j) % ids + 1 for j in range(5)], [(3 + 29 * j) % ids + 1 for j in range(8)]]
    nxt = [11 % ids + 1, 23 % ids + 1]
    want_prefill, want_decode = [], []
    for p, t in zip(prompts, nxt):
        caches = cache_slots(model)
        want_prefill.append(_logits(model(mx.array([p]), cache=caches))[0, -1])
        want_decode.append(_logits(model(mx.array([[t]]), cache=caches))[0, -1])
    try:
        got_prefill, got_decode = _two_row_passes(model, info, prompts, nxt, padded)
    except Exception as e:
        raise UnsupportedModel(f"model type {info.model_type!r} is not served: a batched pass over rows of "
                               f"different lengths fails ({type(e).__name__}: {e})") from e
    noise = _batch_noise(model, info, prompts[1], nxt[1], want_prefill[1], want_decode[1])
    for what, got, want in (("prefill", got_prefill, want_prefill), ("decode", got_decode, want_decode)):
        for row, (g, w) in enumerate(zip(got, want)):
            g, w = g.astype(mx.float32), w.astype(mx.float32)
            scale = max(1.0, mx.abs(w).max().item())
            tol = _logit_tolerance(info)
            diff = mx.abs(g - w).max().item()
            if not diff <= max(tol * scale, 4 * noise):
                why = ("its recurrent scan ignores a padded row's length" if info.has_state else
                       "it reads per-row positions in a way the engine's views do not support")
                raise UnsupportedModel(f"model type {info.model_type!r} is not served: {why} (batched rows of "
                                       f"different lengths give other logits than each sequence alone: {what}, "
                                       f"row {row}, max difference {diff:.3g})")


def _logit_tolerance(info: ModelInfo) -> float:
    """How far (relative to the largest logit) two ways of computing the same logits may round apart: float32
    where its matmuls are exact (parallm.device.exact_float32), else the 16-bit bound (TF32 on CUDA)."""
    return 1e-3 if info.dtype == mx.float32 and exact_float32() else 3e-2


def kv_format_for(model: nn.Module, info: ModelInfo, bits: int, group_size: int) -> KVFormat:
    """The KV format of `kv.bits` for this model: for quantized K/V, how its attention reads them
    (kv_format.py): through the quantized matmuls where its forward runs on them and gives the logits
    it gives on the same K/V dequantized, else dequantized. ValueError naming the flag when the heads
    do not split into groups; UnsupportedModel when the model runs on neither."""
    fmt = KVFormat(info.dtype, bits, group_size)
    if not bits:
        return fmt
    fmt.check(info.shapes)
    ids = max(1, min(50, _vocab_size(model) - 1))
    prompts = [[(5 + 11 * j) % ids + 1 for j in range(6)], [(2 + 17 * j) % ids + 1 for j in range(9)]]
    nxt = [13 % ids + 1, 19 % ids + 1]
    got: dict[str, list[mx.array]] = {}
    failed = ""
    for read in ("matmul", "dequantize"):
        try:
            pre, dec = _two_row_passes(model, info, prompts, nxt, kv_format=dataclasses.replace(fmt, read=read))
            got[read] = [x.astype(mx.float32) for x in pre + dec]
            mx.eval(got[read])
        except Exception as e:  # noqa: BLE001 - attention written by hand reads K/V as arrays
            failed = f"{type(e).__name__}: {e}"
    if "dequantize" not in got:
        raise UnsupportedModel(f"--kv.bits {bits}: model type {info.model_type!r} does not run on quantized K/V "
                               f"({failed}); serve it with --kv.bits 0")
    if "matmul" in got:
        tol = _logit_tolerance(info)
        diff = max(mx.abs(a - b).max().item() / max(1.0, mx.abs(b).max().item())
                   for a, b in zip(got["matmul"], got["dequantize"]))
        if diff <= tol:
            return dataclasses.replace(fmt, read="matmul")
    return dataclasses.replace(fmt, read="dequantize")
