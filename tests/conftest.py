"""Shared test setup: OpenBLAS preloaded for every test process (matmuls ~50x faster on CPU)."""

from parallm import blas

blas.reexec_with_openblas()
