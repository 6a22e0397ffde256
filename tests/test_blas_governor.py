"""The OpenBLAS thread governor: decisions from CPU samples, and the real library's setter."""

from __future__ import annotations

import os

import pytest

from parallm import blas


class Samples:
    """A fake /proc/stat: each tick advances 1 s of wall time with the given busy seconds."""

    def __init__(self) -> None:
        self.wall = self.busy = self.own = 0.0

    def advance(self, others: float, own: float = 0.9) -> None:
        self.wall += 1.0
        self.own += own
        self.busy += others + own

    def __call__(self) -> blas.CpuSample:
        return self.wall, self.busy, self.own


def governor(samples: Samples, cores: int = 2) -> tuple[blas.ThreadGovernor, list[int]]:
    calls: list[int] = []
    g = blas.ThreadGovernor(calls.append, cores, list(range(cores)), interval_s=0.0, sample=samples)
    return g, calls


def test_drops_to_one_thread_when_another_process_keeps_a_core_busy_and_comes_back() -> None:
    samples = Samples()
    g, calls = governor(samples)
    samples.advance(others=1.0)
    g.tick()
    assert calls == [1] and g.threads == 1 and g.others_busy == pytest.approx(1.0)  # down at the first sample
    samples.advance(others=0.05)
    g.tick()
    assert calls == [1] and g.threads == 1  # up only when a second sample agrees
    samples.advance(others=0.05)
    g.tick()
    assert calls == [1, 2] and g.threads == 2
    assert g.stats().thread_changes == 2


def test_light_load_from_the_other_stages_keeps_every_core() -> None:
    samples = Samples()
    g, calls = governor(samples)
    for _ in range(5):
        samples.advance(others=0.3)
        g.tick()
    assert calls == [] and g.threads == 2


def test_a_flapping_sample_switches_down_once_and_not_back_up() -> None:
    samples = Samples()
    g, calls = governor(samples)
    for others in (1.0, 0.0, 1.0, 0.0, 1.0, 0.0):
        samples.advance(others=others)
        g.tick()
    assert calls == [1] and g.threads == 1


def test_target_keeps_at_least_one_thread_and_at_most_the_pool() -> None:
    g, _ = governor(Samples(), cores=4)
    assert [g.target(x) for x in (0.0, 0.4, 0.6, 1.5, 3.9, 8.0)] == [4, 4, 3, 3, 1, 1]


def test_cpu_sample_reads_proc_stat() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    wall, busy, own = blas.cpu_sample()
    w2, b2, o2 = blas.cpu_sample(blas._cpus())
    assert wall > 0 and busy > 0 and own > 0 and b2 > 0 and w2 >= wall and o2 >= own


def test_the_preloaded_openblas_takes_thread_counts() -> None:
    g = blas.ThreadGovernor.for_this_process()
    if g is None:
        pytest.skip("OpenBLAS is not preloaded here")
    import ctypes

    lib = ctypes.CDLL(os.environ[blas.MARK])
    lib.openblas_get_num_threads.restype = ctypes.c_int
    before = lib.openblas_get_num_threads()
    try:
        g._set(1)
        assert lib.openblas_get_num_threads() == 1
    finally:
        g._set(before)


def test_the_trainer_beside_the_engine_keeps_half_the_cores() -> None:
    env = {blas.MARK: "/x/libopenblas.so.0", "OPENBLAS_NUM_THREADS": str(blas.default_threads())}
    assert blas.beside_engine_env(env)["OPENBLAS_NUM_THREADS"] == str(max(1, len(blas._cpus()) // 2))
    assert blas.beside_engine_env({"A": "1"}) == {"A": "1"}
    chosen = {**env, "OPENBLAS_NUM_THREADS": "7"}
    assert blas.beside_engine_env(chosen) is chosen
