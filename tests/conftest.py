"""Shared test setup: OpenBLAS preloaded for every test process (matmuls ~50x faster on CPU).

The preload needs a re-exec. pytest has already redirected fds 1/2 into its capture files
by the time a conftest runs, so capturing is suspended first: otherwise the re-executed
pytest writes its whole report into a capture file nobody reads.
"""

import pytest

from parallm import blas


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if blas.is_preloaded() or blas.openblas_env() is None:
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    blas.reexec_with_openblas()
