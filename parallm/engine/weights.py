"""Full-weight policy updates: new base-model weights swapped into the running model, one layer at a time.

A trainer that updates every weight (not a LoRA adapter) hands the engine a directory of safetensors
files (prime-rl's `/update_weights {weight_dir}`, SGLang's `/update_weights_from_disk {model_path}`)
or streams chunks of safetensors bytes over its PUB socket. Either way the tensors are read and
applied layer by layer: a layer's new arrays are materialised, assigned into the model and
evaluated before the next layer is read, so at most one extra copy of a layer exists at a time
(the replaced arrays are freed once nothing references them; a pass already launched keeps the old
ones until it is read, since MLX arrays are immutable).

Every tensor is checked first (a known parameter name, the parameter's shape, finite values): a
directory is checked whole before anything is applied (it is read twice, lazily), so a bad file
changes nothing. Names are the model's own (mlx-lm) or Hugging Face's, mapped by the model's
`sanitize` when it has one. A checkpoint in another precision than the served model's (a quantized
directory for a model served dequantized, float weights for a quantized one) is converted layer by
layer to the served form (weights_convert.py).

Chunks sent over the PUB socket (`ChunkStaging`) are checked as they come and written to a staging
directory; the update is applied from there, as a directory is, only once its last chunk is in. So an
update that fails midway (a corrupt or misshapen chunk, a chunk missing, the trainer gone quiet past
adapters.weights_chunk_timeout_s) changes nothing, and every request is served on the old weights
until the whole update is applied between two steps.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from parallm.adapters import AdapterError, load_bytes
from parallm.adapters.lora import compute_dtype, dense_weight
from parallm.adapters.sharded import is_sharded, local_linear, shard_tensor
from parallm.files import UnsafeFile, check_regular

from .weights_convert import to_served
from .weights_errors import WeightsError

__all__ = ["WeightsError", "Applied", "WeightSwapper", "ChunkStaging", "by_layer", "layer_of", "load_chunk",
           "rebase_adapters", "safetensors_files"]

log = logging.getLogger("parallm.engine.weights")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class Applied:
    tensors: int
    layers: int
    load_ms: float


def layer_of(name: str) -> int:
    """The transformer layer a tensor belongs to (-1: embeddings, norms, the head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def by_layer(tensors: Mapping[str, mx.array]) -> list[dict[str, mx.array]]:
    groups: dict[int, dict[str, mx.array]] = {}
    for name, value in tensors.items():
        groups.setdefault(layer_of(name), {})[name] = value
    return [groups[k] for k in sorted(groups)]


def safetensors_files(path: str | Path) -> list[Path]:
    root = Path(path)
    if not root.is_dir():
        raise WeightsError(f"weight directory {str(root)!r} does not exist or is not a directory", status=404,
                           code="weights_not_found")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors file in {str(root)!r}", status=404, code="weights_not_found")
    for f in files:  # mx.load opens each itself: a FIFO there would block the step loop until a restart
        try:
            check_regular(f)
        except OSError as exc:
            reason = str(exc) if isinstance(exc, UnsafeFile) else f"cannot open {f.name} ({type(exc).__name__})"
            raise WeightsError(reason, code="invalid_weights") from None
    return files


class WeightSwapper:
    """Checks and applies new values of a model's parameters, in the served precision: a quantized
    checkpoint's layers are dequantized for a float served model, a float checkpoint's quantized as
    the served quantized layers are (weights_convert.to_served)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def _params(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.parameters()))

    def sanitize(self, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hugging Face names to the model's (mlx-lm's model.sanitize), when the model has one."""
        fix = getattr(self.model, "sanitize", None)
        if fix is None:
            return tensors
        try:
            return fix(dict(tensors))
        except Exception:  # noqa: BLE001 - a sanitize that does not fit a partial update: names as given
            return tensors

    def named(self, tensors: Mapping[str, mx.array], params: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Tensors under the running model's parameter names: a linear layer an adapter router wraps
        (parallm.adapters.lora.MultiLoRALinear) holds its weights one level down, in `.linear`. On a
        tensor-parallel rank, a sharded layer's whole tensor becomes this rank's slice of it. Layers
        in another precision than the served one are converted first (weights_convert.to_served)."""
        tensors = to_served(tensors, dict(self.model.named_modules()))
        sharded = {p: m for p, m in self.model.named_modules() if is_sharded(m)}
        out = {}
        for name, value in tensors.items():
            if name not in params:
                head, _, leaf = name.rpartition(".")
                wrapped = f"{head}.linear.{leaf}"
                if wrapped in params:
                    name = wrapped
            head, _, leaf = name.rpartition(".")
            if head in sharded and name in params:
                try:
                    value = shard_tensor(sharded[head], leaf, value)
                except ValueError as exc:
                    raise WeightsError(f"tensor {name!r} {exc}", code="shape_mismatch") from None
            out[name] = value
        return out

    def check(self, tensors: Mapping[str, mx.array], params: Mapping[str, mx.array] | None = None) -> None:
        """WeightsError naming the first tensor that is unknown, misshapen or not finite (changes nothing)."""
        params = self._params() if params is None else params
        for name, value in tensors.items():
            old = params.get(name)
            if old is None:
                raise WeightsError(f"tensor {name!r} is not a parameter of the served model", code="unknown_tensor")
            if tuple(value.shape) != tuple(old.shape):
                raise WeightsError(f"tensor {name!r} has shape {tuple(value.shape)}; the model's is {tuple(old.shape)}",
                                   code="shape_mismatch")
            if mx.issubdtype(old.dtype, mx.floating) != mx.issubdtype(value.dtype, mx.floating):
                raise WeightsError(f"tensor {name!r} is {value.dtype}; the model's is {old.dtype}", code="dtype_mismatch")
            if mx.issubdtype(value.dtype, mx.floating) and not bool(mx.all(mx.isfinite(value)).item()):
                raise WeightsError(f"tensor {name!r} holds NaN or infinite values", code="non_finite")

    def check_chunk(self, tensors: Mapping[str, mx.array]) -> None:
        """`check` of tensors under their names as given or Hugging Face's (a chunk of an update)."""
        params = self._params()
        self.check(self.named(self.sanitize(dict(tensors)), params), params)

    def apply(self, tensors: Mapping[str, mx.array]) -> Applied:
        """Check, then assign layer by layer (each evaluated before the next is read)."""
        t0 = time.perf_counter()
        params = self._params()
        groups = by_layer(self.named(self.sanitize(dict(tensors)), params))
        for group in groups:
            self.check(group, params)
        for group in groups:
            self._assign(group, params)
        return Applied(len(tensors), len(groups), 1000 * (time.perf_counter() - t0))

    def apply_dir(self, path: str | Path) -> Applied:
        """A directory of safetensors: every file checked layer by layer first, then applied layer by layer."""
        t0 = time.perf_counter()
        files = safetensors_files(path)
        params = self._params()
        count = layers = 0
        for apply in (False, True):
            for group in self._dir_groups(files, params):
                if apply:
                    self._assign(group, params)
                    count, layers = count + len(group), layers + 1
                else:
                    self.check(group, params)
        return Applied(count, layers, 1000 * (time.perf_counter() - t0))

    def _dir_groups(self, files: list[Path], params: Mapping[str, mx.array]) -> Iterator[dict[str, mx.array]]:
        """Every tensor of the directory, one layer's worth at a time (MLX loads lazily: a tensor is
        read from disk when it is evaluated)."""
        lazy: dict[str, mx.array] = {}
        for f in files:
            try:
                lazy.update(mx.load(str(f)))
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the client's error
                log.warning("weight update: cannot read %s: %s", f, exc)  # MLX's text names the server path
                raise WeightsError(f"cannot read {f.name}: not a readable safetensors file", code="invalid_weights") \
                    from None
        yield from by_layer(self.named(self.sanitize(lazy), params))

    def _assign(self, group: Mapping[str, mx.array], params: dict[str, mx.array]) -> None:
        values = [(name, value.astype(params[name].dtype)) for name, value in group.items()]
        self.model.load_weights(values, strict=False)
        mx.eval([v for _, v in values])
        for name, value in values:
            params[name] = value


def rebase_adapters(manager) -> int:
    """After new base weights: every loaded adapter version keeps applying on top of them, as vLLM's and
    SGLang's LoRA adapters do (a LoRA is a delta, kept apart from the base). A factored version needs
    nothing; a version merged into copies of base weights is folded again into the new ones, and a
    DoRA version's gains (its magnitude over the norm of the adapted weight) are computed from them, as
    loading it on the new base would (AdapterManager._bind); one module at a time. Returns the modules
    rebuilt. `manager`: the engine's parallm.adapters.AdapterManager."""
    for path, layer in manager.sharded.items():   # a tensor-parallel rank's views share the replaced arrays
        manager.linears[path] = local_linear(layer)
    rebuilt = 0
    for adapters in manager.versions.values():
        for adapter in adapters:
            touched = False
            for path, m in list(adapter.modules.items()):
                if path in manager.switches or (m.merged is None and m.m is None):
                    continue
                linear = manager.linears[path]
                dtype = compute_dtype(linear)
                merged = None
                if m.m is not None:
                    adapted = dense_weight(linear).astype(mx.float32) + \
                        (m.scale * m.b.T.astype(mx.float32)) @ m.a.T.astype(mx.float32)
                    gain = m.m / mx.linalg.norm(adapted, axis=1)
                    adapter.gains[path] = gain.astype(dtype)
                    if m.merged is not None:
                        merged = (gain[:, None] * adapted).astype(dtype)
                else:
                    merged = mx.addmm(linear.weight, m.b.T, m.a.T, alpha=m.scale)
                adapter.modules[path] = replace(m, merged=merged)
                mx.eval(merged, adapter.gains.get(path))
                rebuilt, touched = rebuilt + 1, True
            if touched:
                manager.router.forget(adapter.uid)   # cached stacks hold its old gains
    return rebuilt


@dataclass
class Staged:
    """A chunked update being received: its chunks so far wait in `directory`."""

    update_id: str
    chunks: int
    version: int
    directory: Path
    received: int = 0
    deadline: float = 0.0


class ChunkStaging:
    """The chunks of full-weight updates sent over the trainer's PUB socket, checked as they come and
    staged on disk until the last one is in (see the module docstring). One update at a time: a new chunk 0
    abandons the one being received. Every refusal raises WeightsError and is remembered (`rejected`,
    `last_error`), since a PUB publisher gets no reply."""

    def __init__(self, check: Callable[[dict[str, mx.array]], None], *, root: str = "", timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`check`: raises WeightsError for tensors the served model cannot take (WeightSwapper.check_chunk)."""
        self.check = check
        self.root = root or None
        self.timeout_s = timeout_s
        self.clock = clock
        self.pending: Staged | None = None
        self.spent: list[tuple[Path, int]] = []  # applied updates' directories, kept until every rank has read them
        self.dropped = ""  # the last update dropped: its later chunks are refused without a new error
        self.rejected = 0
        self.last_error = self.last_error_code = ""
        self.last_error_at = 0.0

    def add(self, update_id: str, chunk: int, chunks: int, data: bytes, *, version: int = 0,
            current_version: int = 0) -> Staged | None:
        """Check and stage one chunk. Returns the update once its last chunk is in: apply it from its
        directory, then call `done()`. Raises WeightsError (the update is dropped; nothing was applied)."""
        pending = self.pending
        if chunk == 0:
            if pending is not None:
                self._drop(f"abandoned: update {update_id!r} started before its last chunk came", "abandoned")
            if chunks < 1:
                raise self._refuse(update_id, f"an update of {chunks} chunks", "invalid_weights")
            if version and version <= current_version:
                raise self._refuse(update_id, f"version {version} is not newer than the base model's "
                                   f"{current_version}", "version_conflict", status=409)
            directory = Path(tempfile.mkdtemp(prefix="parallm-weights-", dir=self.root))
            pending = self.pending = Staged(update_id, chunks, version, directory)
        elif update_id == self.dropped and (pending is None or pending.update_id != update_id):
            raise WeightsError(f"chunk {chunk} of full-weight update {update_id!r} ignored: the update was dropped "
                               f"({self.last_error_code})", status=409, code="update_dropped")
        elif pending is None or pending.update_id != update_id:
            raise self._refuse(update_id, f"chunk {chunk} arrived without its update's chunk 0 (never sent, or the "
                               "update was already dropped)", "chunk_out_of_order", status=409)
        elif chunk != pending.received or chunks != pending.chunks:
            what = (f"chunk {pending.received} of {pending.chunks} is missing (chunk {chunk} came next)"
                    if chunks == pending.chunks else f"chunk {chunk} says {chunks} chunks, chunk 0 said {pending.chunks}")
            raise self._drop(what, "chunk_missing" if chunks == pending.chunks else "invalid_weights")
        try:
            self.check(load_chunk(data))
            (pending.directory / f"chunk-{chunk:06d}.safetensors").write_bytes(data)
        except WeightsError as exc:
            raise self._drop(f"chunk {chunk}: {exc.message}", exc.code) from None
        except OSError as exc:
            log.warning("weight update %r: chunk %d could not be staged in %s: %s", update_id, chunk,
                        pending.directory, exc)
            raise self._drop(f"chunk {chunk} could not be staged on the server's disk ({type(exc).__name__})",
                             "staging_failed", status=507) from None
        pending.received += 1
        pending.deadline = self.clock() + self.timeout_s
        return pending if pending.received == pending.chunks else None

    def done(self, error: WeightsError | None = None, *, version: int = 0) -> None:
        """The update `add` returned was refused with `error` (its chunks are deleted), or applied as base
        version `version`: its directory is kept until `sweep` sees every rank serve that version (a
        tensor-parallel group's other ranks read it when they replay the update, after rank 0)."""
        staged, self.pending = self.pending, None
        if staged is None:
            return
        if error is not None:
            shutil.rmtree(staged.directory, ignore_errors=True)
            self._remember(staged.update_id, error)
        else:
            self.spent.append((staged.directory, version))

    def sweep(self, served: Callable[[int], bool]) -> None:
        """Delete the directories of applied updates whose version every rank serves (`served(version)`)."""
        keep = []
        for directory, version in self.spent:
            if served(version):
                shutil.rmtree(directory, ignore_errors=True)
            else:
                keep.append((directory, version))
        self.spent = keep

    def expire(self) -> WeightsError | None:
        """Drop the update being received when its next chunk is overdue; the error, or None."""
        staged = self.pending
        if staged is None or self.clock() < staged.deadline:
            return None
        return self._drop(f"chunk {staged.received} of {staged.chunks} did not come within {self.timeout_s:g} s "
                          "(adapters.weights_chunk_timeout_s)", "chunk_timeout", status=408)

    def close(self) -> None:
        if self.pending is not None:
            shutil.rmtree(self.pending.directory, ignore_errors=True)
            self.pending = None
        self.sweep(lambda version: True)

    def _drop(self, reason: str, code: str, status: int = 400) -> WeightsError:
        staged = self.pending
        self.pending = None
        update_id = staged.update_id if staged is not None else ""
        if staged is not None:
            shutil.rmtree(staged.directory, ignore_errors=True)
            self.dropped = update_id
        error = WeightsError(f"full-weight update {update_id!r} dropped, the served weights unchanged: {reason}",
                             status=status, code=code)
        self._remember(update_id, error)
        return error

    def _refuse(self, update_id: str, reason: str, code: str, status: int = 400) -> WeightsError:
        error = WeightsError(f"full-weight update {update_id!r} refused: {reason}", status=status, code=code)
        self._remember(update_id, error)
        return error

    def _remember(self, update_id: str, error: WeightsError) -> None:
        self.rejected += 1
        self.last_error, self.last_error_code, self.last_error_at = error.message, error.code, time.time()


def load_chunk(data: bytes) -> dict[str, mx.array]:
    """A chunk's tensors (safetensors bytes); WeightsError when they are not readable."""
    try:
        return load_bytes(data)
    except AdapterError as exc:
        raise WeightsError(f"not readable safetensors bytes: {exc.message}", code="invalid_weights") from None
