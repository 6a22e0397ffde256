"""Preloading OpenBLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheels link a reference BLAS (~3 GFLOP/s). Preloading the OpenBLAS that the
`cmeel-openblas` wheel ships replaces its cblas symbols and makes matmuls 15-60x faster. That
OpenBLAS needs `libgfortran.so.5`, which many machines lack; MLX's wheel bundles a renamed copy
in `mlx_cpu.libs`, so a shim directory of links under those names satisfies the loader.

This must happen before the process starts (LD_PRELOAD), so it is applied to a child's
environment (`openblas_env`) or by re-executing the current process (`reexec_with_openblas`).
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import os
import platform
import sys
import tempfile
from pathlib import Path

MARK = "PARALLM_BLAS_PRELOADED"


def _site_file(dist: str, suffix: str) -> Path | None:
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if str(entry).endswith(suffix):
            path = Path(entry.locate()).resolve()
            if path.exists():
                return path
    return None


def find_openblas() -> Path | None:
    """The libopenblas.so.0 of the cmeel-openblas wheel, if installed."""
    return _site_file("cmeel-openblas", "lib/libopenblas.so.0")


def _mlx_bundled_libs() -> list[Path]:
    lib = _site_file("mlx-cpu", "libgfortran") or _site_file("mlx", "libgfortran")
    if lib is None:
        for dist in ("mlx-cpu", "mlx"):
            try:
                files = importlib.metadata.distribution(dist).files or []
            except importlib.metadata.PackageNotFoundError:
                continue
            for entry in files:
                if "libgfortran" in str(entry):
                    lib = Path(entry.locate()).resolve()
                    break
    return sorted(lib.parent.iterdir()) if lib is not None else []


def _gfortran_shim_dir() -> Path | None:
    """A directory where `libgfortran.so.5` resolves, or None when the system already has it."""
    if ctypes.util.find_library("gfortran"):
        return None
    bundled = _mlx_bundled_libs()
    gfortran = next((p for p in bundled if p.name.startswith("libgfortran")), None)
    if gfortran is None:
        return None
    shim = Path(tempfile.gettempdir()) / f"parallm-blas-shim-{os.getuid()}"
    shim.mkdir(exist_ok=True)
    links = {p.name: p for p in bundled}
    links["libgfortran.so.5"] = gfortran
    for name, target in links.items():
        link = shim / name
        if not (link.is_symlink() and Path(os.readlink(link)) == target):
            tmp = shim / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            os.replace(tmp, link)
    return shim


def openblas_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """`env` plus the variables that preload OpenBLAS, or None where it does not apply or is missing."""
    if platform.system() != "Linux":
        return None
    openblas = find_openblas()
    if openblas is None:
        return None
    out = dict(os.environ if env is None else env)
    preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p]
    if str(openblas) not in preload:
        preload.insert(0, str(openblas))
    out["LD_PRELOAD"] = ":".join(preload)
    shim = _gfortran_shim_dir()
    if shim is not None:
        paths = [p for p in out.get("LD_LIBRARY_PATH", "").split(":") if p]
        if str(shim) not in paths:
            paths.insert(0, str(shim))
        out["LD_LIBRARY_PATH"] = ":".join(paths)
    out.setdefault("OPENBLAS_NUM_THREADS", str(default_threads()))
    out[MARK] = str(openblas)
    return out


def default_threads() -> int:
    """OpenBLAS threads for the engine: half the cores it may use (at least one). The other
    stages and the clients share the machine; a full-width pool on busy cores collapsed (decode at
    batch 16: 12.9 tok/s with the default pool vs 51.4 with one thread, perf/results/engine-cpu.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def is_preloaded() -> bool:
    return bool(os.environ.get(MARK)) and os.environ[MARK] in os.environ.get("LD_PRELOAD", "")


def reexec_with_openblas() -> None:
    """Re-execute this Python process with OpenBLAS preloaded (no-op where done or not applicable)."""
    if is_preloaded() or os.environ.get("PARALLM_NO_OPENBLAS"):
        return
    env = openblas_env()
    if env is None:
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
