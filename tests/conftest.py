"""Shared test setup: OpenBLAS preloaded for every test process (matmuls ~50x faster on CPU).

The preload needs a re-exec. pytest has already redirected fds 1/2 into its capture files
by the time a conftest runs, so capturing is suspended first: otherwise the re-executed
pytest writes its whole report into a capture file nobody reads.

With pytest-xdist workers (`make test` runs two), each worker and the servers it starts get an
equal share of the cores for their OpenBLAS pool: pools that together ask for more threads than
there are cores spin against each other and run several times slower (docs/testing.md).
"""

import os

import pytest

from parallm import blas


def _share_cores(config) -> None:
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 1 and "OPENBLAS_NUM_THREADS" not in os.environ:
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, blas.default_threads() // workers))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if blas.is_preloaded() or blas.openblas_env() is None:
        return
    _share_cores(config)
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

