"""Which thread of a stage process does what: OS thread names for our Python threads, a lower OS
priority for the threads that do work on behalf of requests not yet running (`background_worker`), and an
optional sampler of every Python thread's stack (perf/profile_threads.py reads both).

Python (before 3.14) leaves a thread's OS name as the process's, so `top -H`, /proc/PID/task/TID/comm
and py-spy's native view cannot tell the heartbeat thread from MLX's or OpenBLAS's; `name_os_thread`
gives the calling thread its Python name there (15 bytes, Linux only).

With PARALLM_THREAD_SAMPLES=DIR set, `start_sampler` runs a daemon thread in the stage that every
PARALLM_THREAD_SAMPLE_MS (default 5) reads `sys._current_frames()` and counts, per thread, where it
stood: its innermost frame and the innermost frame of parallm's own code. Taking a sample needs the
GIL, so how late the sampler wakes past its interval is the time some other thread held the GIL (or
the CPU was busy): `late_ms` sums it and `late_max_ms` is the longest. Cumulative counts are written
to DIR/<stage>-<pid>.json about once a second (atomically), so a reader diffs two readings.
Off (no thread, no cost) unless the variable is set.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ENV_DIR = "PARALLM_THREAD_SAMPLES"
ENV_MS = "PARALLM_THREAD_SAMPLE_MS"
_PR_SET_NAME = 15
_OURS = (os.sep + "parallm" + os.sep, os.sep + "stages" + os.sep)


def name_os_thread(name: str | None = None) -> None:
    """Set the calling thread's OS name (default: its Python name), cut to the kernel's 15 bytes."""
    if not sys.platform.startswith("linux"):
        return
    raw = (name or threading.current_thread().name).encode(errors="replace")[:15]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)
    except (OSError, AttributeError):
        pass


BACKGROUND_NICE = 10  # how much lower (in nice steps) a background worker runs than the thread that started it


def lower_priority(steps: int = BACKGROUND_NICE) -> bool:
    """Run the calling thread `steps` nice levels below where it is (Linux: nice is per thread, set on its
    native id; raising it needs no privilege). Whether it was lowered: elsewhere (macOS, where the
    call would apply to the whole process) it is left alone.

    Work done for requests that are not running yet (a grammar compiling, a large prompt tokenizing, an
    adapter's files read) competes with the engine's step for the cores. On the 2-core CPU a step whose
    OpenBLAS pool lost a core to such a thread took 0.6-1.7 s instead of 0.1 s (issue 30: a canary beside
    three 64 KiB grammars at once or a 64 KiB tool schema); ten nice levels below, the scheduler hands
    the core back to the step's threads as soon as they wake, and the background work runs in their gaps."""
    if not sys.platform.startswith("linux") or steps <= 0:
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except (OSError, AttributeError):
        return False
    return True


def background_worker() -> None:
    """A ThreadPoolExecutor initializer for a background worker: its OS name, then a lower priority."""
    name_os_thread()
    lower_priority()


def _where(frame) -> str:
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"


def _ours(frame) -> str:
    """The innermost frame of parallm's own code (stages/ or parallm/), or '' if none."""
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _OURS):
            return _where(frame)
        frame = frame.f_back
    return ""


class ThreadSampler:
    """Counts where each Python thread stands, every `interval_s` (see the module docstring)."""

    def __init__(self, path: Path, interval_s: float = 0.005, write_every_s: float = 1.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self.write_every_s = write_every_s
        self.samples = 0
        self.late_s = 0.0
        self.late_max_s = 0.0
        self.frames: dict[int, Counter[str]] = {}
        self.me = 0

    def sample(self) -> None:
        for ident, frame in sys._current_frames().items():
            if ident == self.me:
                continue
            ours = _ours(frame)
            inner = _where(frame)
            key = inner if not ours or ours == inner else f"{inner} <- {ours}"
            self.frames.setdefault(ident, Counter())[key] += 1
        self.samples += 1

    def snapshot(self) -> dict:
        names = {t.ident: (t.name, t.native_id) for t in threading.enumerate()}
        threads = {}
        for ident, counts in self.frames.items():
            name, tid = names.get(ident, ("(ended)", None))
            threads[str(tid or ident)] = {"name": name, "tid": tid, "frames": dict(counts.most_common(40)),
                                          "samples": sum(counts.values())}
        return {"pid": os.getpid(), "interval_ms": 1000 * self.interval_s, "samples": self.samples,
                "late_ms": round(1000 * self.late_s, 3), "late_max_ms": round(1000 * self.late_max_s, 3),
                "threads": threads}

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self.path)

    def run(self) -> None:
        name_os_thread("thread-sampler")
        self.me = threading.get_ident()
        clock = time.perf_counter
        next_write = clock() + self.write_every_s
        while True:
            asked = clock()
            time.sleep(self.interval_s)
            late = clock() - asked - self.interval_s
            if late > 0:
                self.late_s += late
                self.late_max_s = max(self.late_max_s, late)
            self.sample()
            if clock() >= next_write:
                next_write = clock() + self.write_every_s
                try:
                    self.write()
                except OSError:
                    pass


def start_sampler(stage: str) -> ThreadSampler | None:
    """Start the sampler thread when PARALLM_THREAD_SAMPLES names a directory; None otherwise."""
    where = os.environ.get(ENV_DIR)
    if not where:
        return None
    Path(where).mkdir(parents=True, exist_ok=True)
    sampler = ThreadSampler(Path(where) / f"{stage}-{os.getpid()}.json",
                            float(os.environ.get(ENV_MS, "5")) / 1000)
    threading.Thread(target=sampler.run, name="thread-sampler", daemon=True).start()
    return sampler
