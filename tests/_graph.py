"""Count the primitives of an MLX graph (what `mx.export_to_dot` draws as operations), for tests that
pin how many operations a pass builds (perf.harness.graph_primitives, which the benchmarks count with)."""

from perf.harness import graph_primitives as primitives  # noqa: F401
