"""The OpenBLAS thread governor: decisions from CPU samples, and the real library's setter."""

from __future__ import annotations

import os

import pytest

from parallm import blas


class Samples:
    """A fake /proc/stat: each advance is `seconds` (1 s unless given) of wall time with `others` and `own`
    cores busy."""

    def __init__(self) -> None:
        self.wall = self.busy = self.own = 0.0

    def advance(self, others: float, own: float = 0.9, seconds: float = 1.0) -> None:
        self.wall += seconds
        self.own += own * seconds
        self.busy += (others + own) * seconds

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


def test_a_burst_is_seen_within_a_window_however_long_the_quiet_before_it() -> None:
    """Issue 30: sampled from the engine's loop over the time since its last sample, a burst that began while the
    engine waited for requests was averaged with the idle time before it, and the next step ran on a contended
    pool (a canary's 3-token pass 1-2.4 s). Sampled every 0.1 s, the last 0.2 s decide."""
    samples = Samples()
    g, calls = governor(samples)
    for _ in range(30):  # 3 s idle
        samples.advance(others=0.0, own=0.0, seconds=0.1)
        g.tick()
    samples.advance(others=1.0, own=0.0, seconds=0.1)
    g.tick()
    assert calls == []  # half the window
    samples.advance(others=1.0, own=0.0, seconds=0.1)
    g.tick()
    assert calls == [1] and g.others_busy == pytest.approx(1.0)


def test_more_threads_only_after_every_sample_of_a_second_asked_for_them() -> None:
    samples = Samples()
    calls: list[int] = []
    g = blas.ThreadGovernor(calls.append, 2, [0, 1], interval_s=0.0, window_s=0.25, up_after_s=1.0, sample=samples)

    def quiet(n: int) -> None:
        for _ in range(n):
            samples.advance(others=0.0, seconds=0.125)
            g.tick()

    samples.advance(others=1.0, seconds=0.25)
    g.tick()
    assert calls == [1]
    quiet(9)  # the first sample's window still holds the burst; the next eight span 0.875 s
    samples.advance(others=1.0, seconds=0.25)  # a burst again: the quiet run starts over
    g.tick()
    quiet(9)
    assert calls == [1]
    quiet(1)  # 1 s of samples that all ask for two threads
    assert calls == [1, 2]


def test_background_work_of_this_process_takes_a_core_at_once_and_gives_it_back_when_done() -> None:
    """Issue 30: a grammar compiling on the engine's compile thread is this process's own CPU time, which the
    samples cannot tell from the step's; beside three 64 KiB grammars compiling, a one-row decode took 150-280 ms
    instead of 30 on a pool whose threads waited for the core the compile held."""
    samples = Samples()
    g, calls = governor(samples)
    with g.background():
        assert calls == [1] and g.threads == 1 and g.background_work == 1  # before any sample
        with g.background():  # a second at once: nothing below one thread
            assert calls == [1]
        samples.advance(others=0.0)
        g.tick()  # a quiet sample does not take the core back while the work runs
        assert calls == [1]
    assert calls == [1, 2] and g.threads == 2 and g.background_work == 0  # at once, not after up_after_s


def test_background_work_gives_back_only_what_the_other_processes_leave() -> None:
    samples = Samples()
    g, calls = governor(samples, cores=4)
    with g.background():
        assert calls == [3]
        samples.advance(others=1.0)
        g.tick()  # another process took a core meanwhile
        assert calls == [3, 2]
    assert calls == [3, 2, 3] and g.threads == 3  # the background's core back, not the other process's
    samples.advance(others=1.0)
    g.tick()
    assert calls == [3, 2, 3]


def test_background_work_beside_a_busy_machine_changes_nothing_it_need_not() -> None:
    samples = Samples()
    g, calls = governor(samples)
    samples.advance(others=1.0)
    g.tick()
    assert calls == [1]
    with g.background():  # already at one thread (the floor)
        pass
    assert calls == [1] and g.threads == 1


def test_the_governor_samples_on_a_thread_of_its_own() -> None:
    """Started, it needs no call from the engine's loop (idle, or in the middle of a long step)."""
    import time

    start = time.monotonic()

    def sample() -> blas.CpuSample:  # another process keeps a core busy from now on
        wall = time.monotonic()
        return wall, wall - start, 0.0

    calls: list[int] = []
    g = blas.ThreadGovernor(calls.append, 2, [0, 1], interval_s=0.02, window_s=0.05, sample=sample)
    g.start()
    try:
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        g.stop()
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
