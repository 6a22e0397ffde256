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


@pytest.fixture
def engines():
    """Engines made through this list get check_integrity() (and a leak check when idle) at teardown."""
    made = []
    yield made
    for engine in made:
        engine.check_integrity()
        if not engine.has_work():
            stats = engine.stats()
            assert stats.kv_blocks_used == 0, "idle engine still holds prefix-cache blocks"
            assert stats.running == stats.prefilling == stats.waiting == 0
