"""Test-session setup shared by every test module."""

from __future__ import annotations

import pytest

from parallm import blas


def pytest_configure(config: pytest.Config) -> None:
    # MLX's Linux CPU wheels link a slow reference BLAS: re-run pytest with OpenBLAS preloaded so
    # tests that run models take seconds, not minutes (a no-op where it does not apply or is done).
    # Output capture is stopped first, or the new process would write into pytest's capture files.
    if blas.is_preloaded() or blas.openblas_env() is None:
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()
    blas.reexec_with_openblas()
