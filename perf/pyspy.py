"""py-spy around a served run (perf/profile_threads.py): non-blocking recordings of every thread's
on-CPU samples and of the GIL holder's, and `dump --native` snapshots of the native frames under
each Python thread. py-spy reads another process's memory (ptrace), which a container may forbid:
failures are recorded, not raised. On the GPU machine (no registry) the py_spy wheel has to be
staged with the others (.gpu/b); installed with --target /tmp/site its binary is /tmp/site/bin/py-spy.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Self


def find_py_spy(choice: str) -> str | None:
    if choice == "off":
        return None
    if choice != "auto":
        return choice
    return shutil.which("py-spy") or next((p for p in ("/tmp/site/bin/py-spy", "/tmp/pyspy/bin/py-spy")
                                           if os.access(p, os.X_OK)), None)


class PySpy:
    """Two non-blocking py-spy recordings of one process while a run lasts: on-CPU samples of
    every thread (`active`) and of the GIL holder only (`gil`)."""

    def __init__(self, binary: str, pid: int, rate: int, work: Path) -> None:
        self.runs = {}
        for kind, flags in (("active", []), ("gil", ["--gil"])):
            out = work / f"pyspy-{kind}-{pid}.txt"
            out.unlink(missing_ok=True)
            proc = subprocess.Popen([binary, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                                     "--threads", "--nonblocking", *flags, "-o", str(out)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.runs[kind] = (proc, out)

    def stop(self, top: int = 6) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for kind, (proc, out) in self.runs.items():
            proc.send_signal(signal.SIGINT)
            try:
                log, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                log, _ = proc.communicate()
            if not out.is_file():
                result[kind] = {"error": log.strip()[-500:]}
                continue
            result[kind] = parse_raw(out.read_text(), top)
            result[kind]["log"] = log.strip().splitlines()[-1:] if log.strip() else []
        return result


class NativeDumps:
    """`py-spy dump --native` of one process every `every_s` while a run lasts (at most `count`): the
    native frames under each Python thread's stack (e.g. a wait on the GPU, a kernel launch, a lock).
    Each dump stops the process for a moment."""

    def __init__(self, binary: str, pid: int, count: int, every_s: float = 0.5) -> None:
        self.argv = [binary, "dump", "--native", "--pid", str(pid)]
        self.count, self.every_s = count, every_s
        self.stacks: dict[str, Counter[str]] = {}
        self.errors: list[str] = []
        self.taken = 0
        self.seconds: list[float] = []  # each dump's duration (py-spy's run; the process stops for part of it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="native-dumps", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while self.taken < self.count and not self._stop.wait(self.every_s):
            t0 = time.perf_counter()
            try:
                done = subprocess.run(self.argv, capture_output=True, text=True, timeout=20, check=False)
            except (OSError, subprocess.SubprocessError) as exc:
                self.errors.append(str(exc))
                return
            if done.returncode != 0:
                self.errors.append((done.stderr or done.stdout).strip()[-300:])
                return
            self.taken += 1
            self.seconds.append(round(time.perf_counter() - t0, 3))
            for thread, frames in parse_dump(done.stdout).items():
                name, _, status = thread.rpartition(" ")
                self.stacks.setdefault(name, Counter())[f"{status} " + " <- ".join(frames[:4])] += 1

    def report(self, top: int = 4) -> dict[str, Any]:
        return {"dumps": self.taken, "dump_s": self.seconds, "errors": self.errors[:3],
                "stacks": {t: dict(c.most_common(top)) for t, c in self.stacks.items()}}


def parse_dump(text: str) -> dict[str, list[str]]:
    """`py-spy dump` output -> 'TID NAME (status)' -> its frames, innermost first."""
    threads: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("Thread "):
            head, _, name = line.partition(": ")
            tid, _, status = head[len("Thread "):].partition(" ")
            current = f"{tid} {name.strip(chr(34))} {status}"
            threads[current] = []
        elif current is not None and line.startswith("    "):
            threads[current].append(line.strip())
    return threads


def parse_raw(text: str, top: int) -> dict[str, Any]:
    """py-spy's raw format (`thread (TID): NAME;frame;...;frame COUNT` per line) -> samples per thread and
    each thread's most frequent innermost frames."""
    threads: dict[str, Counter[str]] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, leaf = frames[0], frames[-1]
        threads.setdefault(thread, Counter())[leaf] += int(count)
    return {"samples": {t: sum(c.values()) for t, c in threads.items()},
            "top": {t: dict(c.most_common(top)) for t, c in threads.items()}}
