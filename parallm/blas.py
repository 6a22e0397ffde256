"""Preloading OpenBLAS (and mimalloc) for MLX's Linux CPU backend.

MLX's Linux CPU wheels link a reference BLAS (~3 GFLOP/s). Preloading the OpenBLAS that the
`cmeel-openblas` wheel ships replaces its cblas symbols and makes matmuls 15-60x faster. That
OpenBLAS needs `libgfortran.so.5`, which many machines lack; MLX's wheel bundles a renamed copy
in `mlx_cpu.libs`, so a shim directory of links under those names satisfies the loader.

MLX's CPU allocator takes every op's output buffer straight from malloc and frees it after
use, and glibc's malloc splits, coalesces and consolidates free chunks for it (`_int_malloc`,
`malloc_consolidate` and `unlink_chunk` in a `perf` profile of the engine's main thread): a
batch-16 decode step of the default model takes 97.9 ms against 85.6 ms with mimalloc (medians
of three processes each, perf/results/step-cpu.json). The mimalloc that the `cmeel-mimalloc`
wheel ships is preloaded beside OpenBLAS (docs/performance.md); set `PARALLM_NO_MIMALLOC=1` (or
`supervisor.allocator=system`) to keep glibc's.

This must happen before the process starts (LD_PRELOAD), so it is applied to a child's
environment (`openblas_env`) or by re-executing the current process (`reexec_with_openblas`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.metadata
import logging
import math
import os
import platform
import re
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from parallm.protocol import BlasStats

log = logging.getLogger(__name__)

MARK = "PARALLM_BLAS_PRELOADED"
NO_MIMALLOC = "PARALLM_NO_MIMALLOC"
# OpenBLAS workers spin for 2^n cycles after a call before they sleep (default n = 28, ~0.1 s:
# they never sleep between a decode step's matmuls, and hold a core the other stages need to take
# new requests). 2^16 cycles is ~25 us. Served, 16 chat streams: time to first token p50 0.87 ->
# 0.78 s, same throughput (docs/performance.md).
THREAD_SPIN_LOG2_CYCLES = 16


def _site_file(dist: str, suffix: str) -> Path | None:
    """The first existing file of `dist` whose path ends with a match of the regex `suffix`."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if re.search(f"(?:{suffix})$", str(entry)):
            path = Path(entry.locate()).resolve()
            if path.exists():
                return path
    return None


def find_openblas() -> Path | None:
    """The libopenblas.so.0 of the cmeel-openblas wheel, if installed."""
    return _site_file("cmeel-openblas", r"lib/libopenblas\.so\.0")


def find_mimalloc() -> Path | None:
    """The libmimalloc.so.<major> of the cmeel-mimalloc wheel, if installed."""
    return _site_file("cmeel-mimalloc", r"lib/libmimalloc\.so\.\d+")


def _is_mimalloc(path: str) -> bool:
    return Path(path).name.startswith("libmimalloc.so")


def preloaded_allocator(env: dict[str, str] | None = None) -> str:
    """Which malloc `env` (this process's by default) preloads: "mimalloc" or "system"."""
    preload = (os.environ if env is None else env).get("LD_PRELOAD", "")
    return "mimalloc" if any(_is_mimalloc(p) for p in preload.split(":") if p) else "system"


def without_preloads(env: dict[str, str]) -> dict[str, str]:
    """`env` without the OpenBLAS and mimalloc preloads of `openblas_env`: the environment a
    process started by the user would have (e.g. a server launched from a re-executed benchmark,
    whose supervisor decides what each of its processes preloads)."""
    out = dict(env)
    blas = out.pop(MARK, None)
    preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p and p != blas and not _is_mimalloc(p)]
    if preload:
        out["LD_PRELOAD"] = ":".join(preload)
    else:
        out.pop("LD_PRELOAD", None)
    return out


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


def openblas_env(env: dict[str, str] | None = None, *, allocator: bool = True) -> dict[str, str] | None:
    """`env` plus the variables that preload OpenBLAS, or None where it does not apply or is missing.
    With `allocator`, mimalloc is preloaded too where installed, unless `env` sets
    PARALLM_NO_MIMALLOC."""
    if platform.system() != "Linux":
        return None
    openblas = find_openblas()
    if openblas is None:
        return None
    out = dict(os.environ if env is None else env)
    preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p]
    if str(openblas) not in preload:
        preload.insert(0, str(openblas))
    if allocator and not out.get(NO_MIMALLOC):
        mimalloc = find_mimalloc()
        if mimalloc is not None and str(mimalloc) not in preload:
            preload.insert(0, str(mimalloc))
    else:  # e.g. inherited from a parent process that preloads it
        preload = [p for p in preload if not _is_mimalloc(p)]
    out["LD_PRELOAD"] = ":".join(preload)
    shim = _gfortran_shim_dir()
    if shim is not None:
        paths = [p for p in out.get("LD_LIBRARY_PATH", "").split(":") if p]
        if str(shim) not in paths:
            paths.insert(0, str(shim))
        out["LD_LIBRARY_PATH"] = ":".join(paths)
    out.setdefault("OPENBLAS_NUM_THREADS", str(default_threads()))
    out.setdefault("OPENBLAS_THREAD_TIMEOUT", str(THREAD_SPIN_LOG2_CYCLES))
    out[MARK] = str(openblas)
    return out


def default_threads() -> int:
    """The OpenBLAS pool of the engine: every core it may use. How many of them a call uses is
    governed at run time (`ThreadGovernor`), because a full-width pool on cores that another
    process keeps busy collapses (see the class)."""
    return len(_cpus())


def beside_engine_env(env: dict[str, str], share: int = 1) -> dict[str, str]:
    """`env` (an engine environment) for a process that computes while the engine does, with no
    governor of its own (the trainer: its updates run while the engine generates the next
    rollouts): half the cores where `env` has the engine's default pool (a value set by the user
    stays), split among `share` such processes (several trainers)."""
    if MARK not in env or env.get("OPENBLAS_NUM_THREADS") != str(default_threads()):
        return env
    return {**env, "OPENBLAS_NUM_THREADS": str(max(1, len(_cpus()) // 2 // max(1, share)))}


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return list(range(os.cpu_count() or 1))


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


CpuSample = tuple[float, float, float]  # (wall seconds, busy seconds of our cores, this process's CPU seconds)


def cpu_sample(cpus: list[int] | None = None) -> CpuSample:
    """Wall clock, the busy time of `cpus` (all of them by default) from /proc/stat, and the CPU
    time of this process (every thread): their differences give what other processes used."""
    wanted = None if cpus is None else {f"cpu{c}" for c in cpus}
    hz = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name != "cpu" if wanted is None else name not in wanted:
                continue
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
            busy += user + nice + system + irq + softirq + steal
    return time.monotonic(), busy / hz, time.process_time()


class ThreadGovernor:
    """How many of its threads OpenBLAS uses, set from the cores other processes leave idle.

    OpenBLAS splits a matmul over its threads and waits for all of them, so one thread that
    another busy process keeps off its core stalls every call. Measured on the 2-core CI machine
    (served HTTP, c=16, default model): 108 tok/s with 2 threads on a quiet machine against 80
    with one; with one other process spinning on a core, 11 tok/s with 2 threads and still 80 with
    one. So the engine measures the CPU time other processes used on its cores and uses the cores
    left over (at least one thread): fewer threads as soon as the last `window_s` asks for them, more
    only once every sample for `up_after_s` has asked for them. The cost is lopsided (a contended
    pool runs ~7-20x slower, one thread too few ~0.74x).

    `start()` samples on a thread of its own every `interval_s` and sets the count from there, so a
    burst that begins while the engine is idle, or in the middle of a step, is seen within one
    interval: sampled from the engine's loop (at most every 0.5 s, over the time since the last
    sample), a burst that began while the engine waited for requests was averaged with the idle
    time before it, and the first step after it ran on a contended pool (issue 30: a canary's 3-token
    pass took 1-2.4 s as an attack began to keep ingress busy, 0.14 s once the pool was down to one
    thread). OpenBLAS reads its thread count when a call begins, so a change from this thread takes
    effect at the next matmul (MLX calls OpenBLAS from its own stream thread, never this one).

    The engine's own background work (a request's grammar compiling on the compile thread) is this
    process's CPU time, which the samples cannot tell from the step's: the thread doing it says so
    (`background()`), and for as long as it runs the count leaves it a core, at once, not a window
    later (issue 30: beside three 64 KiB grammars compiling, 30 ms one-row decodes took 150-280 ms, the
    compile thread using 110-136 ms of CPU in the step and the pool's threads waiting 60-110 ms for a core).
    """

    def __init__(self, set_threads: Callable[[int], None], max_threads: int, cpus: list[int], *,
                 interval_s: float = 0.1, window_s: float = 0.2, up_after_s: float = 1.0,
                 sample: Callable[[], CpuSample] | None = None) -> None:
        self._set = set_threads
        self.max_threads = max(1, max_threads)
        self.cpus = cpus
        self.interval_s = interval_s
        self.window_s = window_s
        self.up_after_s = up_after_s
        self._sample = sample or (lambda: cpu_sample(cpus))
        self._history: deque[CpuSample] = deque([self._sample()])
        self._up_since: float | None = None  # wall time of the first sample of a run asking for more threads
        self._up_to = 0  # the fewest threads a sample of that run asked for
        self.threads = self.max_threads
        self.others_busy = 0.0
        self.changes = 0
        self.background_work = 0  # this process's background jobs running now (`background()`)
        self._restore_to: int | None = None  # the count before background work lowered it
        self._lock = threading.Lock()  # tick() on the sampling thread, background() on the worker's
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    def for_this_process(cls) -> "ThreadGovernor | None":
        """A governor for the OpenBLAS preloaded into this process (None where there is none)."""
        if not is_preloaded() or not os.path.exists("/proc/stat"):
            return None
        try:
            lib = ctypes.CDLL(os.environ[MARK])
            set_threads, get_threads = lib.openblas_set_num_threads, lib.openblas_get_num_threads
        except (OSError, AttributeError):
            return None
        set_threads.argtypes = [ctypes.c_int]
        get_threads.restype = ctypes.c_int
        return cls(set_threads, int(get_threads()), _cpus())

    def target(self, others_busy: float) -> int:
        """Threads for a machine where other processes keep `others_busy` of our cores busy (and this process's
        background work one core each)."""
        free = len(self.cpus) - others_busy - self.background_work
        return max(1, min(self.max_threads, math.floor(free + 0.5)))

    def _others(self, now: CpuSample) -> float:
        """Cores other processes kept busy over the last `window_s` (at least; back to the newest sample
        that old, else the oldest kept)."""
        ref = self._history[0]
        for old in self._history:
            if now[0] - old[0] < self.window_s:
                break
            ref = old
        wall = now[0] - ref[0]
        if wall <= 0:
            return self.others_busy
        return max(0.0, ((now[1] - ref[1]) - (now[2] - ref[2])) / wall)

    def tick(self) -> None:
        """Take a sample and set the thread count from it (the sampling thread calls it every `interval_s`)."""
        if self.max_threads == 1:
            return
        with self._lock:
            self._tick()

    def _tick(self) -> None:
        now = self._sample()
        self.others_busy = self._others(now)
        self._history.append(now)
        while len(self._history) > 2 and now[0] - self._history[1][0] >= self.window_s:
            self._history.popleft()
        want = self.target(self.others_busy)
        if want < self.threads:  # fewer threads at once: a contended pool stalls 10x
            self._change(want)
        elif want == self.threads:
            self._up_since = None
        elif self._up_since is None:
            self._up_since, self._up_to = now[0], want
        else:
            self._up_to = min(self._up_to, want)
            if now[0] - self._up_since >= self.up_after_s:
                self._change(self._up_to)

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """This process's background work runs inside the block (on the calling thread): one core fewer for
        the pool from its start, and the count it lowered is given back as soon as the last such block ends
        (where the last sample of other processes still allows it), not after `up_after_s`: its cause is known
        to be gone."""
        if self.max_threads == 1:
            yield
            return
        with self._lock:
            self.background_work += 1
            want = self.target(self.others_busy)
            if want < self.threads:
                if self._restore_to is None:
                    self._restore_to = self.threads
                self._change(want, "background work")
        try:
            yield
        finally:
            with self._lock:
                self.background_work -= 1
                if self.background_work == 0 and self._restore_to is not None:
                    want = min(self._restore_to, self.target(self.others_busy))
                    self._restore_to = None
                    if want > self.threads:
                        self._change(want, "background work done")

    def _change(self, want: int, why: str = "") -> None:
        if why:  # as often as grammars compile: not worth a line each at info
            log.debug("OpenBLAS threads %d -> %d (%s)", self.threads, want, why)
        else:
            log.info("OpenBLAS threads %d -> %d (other processes keep %.2f of %d cores busy)",
                     self.threads, want, self.others_busy, len(self.cpus))
        self._set(want)
        self.threads = want
        self.changes += 1
        self._up_since = None

    def start(self) -> None:
        """Sample and govern on a daemon thread of its own (`stop()` ends it)."""
        if self._thread is not None or self.max_threads == 1:
            return

        def run() -> None:
            from parallm.threads import name_os_thread

            name_os_thread("blas-governor")
            while not self._stop.wait(self.interval_s):
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - a failed sample (e.g. /proc gone at exit) never ends the engine
                    log.exception("the OpenBLAS thread governor failed a sample")

        self._thread = threading.Thread(target=run, name="blas-governor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> BlasStats:
        from parallm.protocol import BlasStats

        return BlasStats(threads=self.threads, others_busy_cores=round(self.others_busy, 2),
                         thread_changes=self.changes)
