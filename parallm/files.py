"""Reading files a client names (adapters, full-weight updates) without letting the file stall a stage.

A path under an allowed directory may still be a FIFO, a device or a socket: opening a FIFO for reading
blocks until a writer appears, and reading /dev/zero never ends. Such a file stalled the engine's step
loop until the supervisor restarted it (issue 30). Here a file is opened without blocking
(O_NONBLOCK), accepted only when fstat says it is a regular file, and read on a thread of its own that
the caller waits on for at most `timeout_s`: a read that hangs (a dead network mount) costs the caller
that long, once, and the stuck thread is left behind (it holds no lock).
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Callable, TypeVar

DEFAULT_TIMEOUT_S = 30.0
T = TypeVar("T")


class UnsafeFile(OSError):
    """The file is not a regular file, or could not be read in time."""


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of `path`, a regular file (symlinks followed); UnsafeFile for a FIFO, device,
    socket or directory, without blocking on it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{Path(path).name} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | Path) -> None:
    """UnsafeFile unless `path` is a regular file (for readers that open it themselves, e.g. mx.load)."""
    os.close(open_regular(path))


def read_regular(path: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int | None = None) -> bytes:
    """The bytes of regular file `path`, read on a thread of its own; UnsafeFile when it is not a regular
    file, is larger than `max_bytes`, or is not read within `timeout_s`."""
    fd = open_regular(path)
    size = os.fstat(fd).st_size
    if max_bytes is not None and size > max_bytes:
        os.close(fd)
        raise UnsafeFile(f"{Path(path).name} is {size} bytes; the limit is {max_bytes}")
    data = _on_thread(lambda: _read_fd(fd, None if max_bytes is None else max_bytes + 1), timeout_s,
                      f"reading {Path(path).name}")
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsafeFile(f"{Path(path).name} is larger than the limit of {max_bytes} bytes")
    return data


def prefetch_regular(paths: list[Path], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Read regular files `paths` through once, keeping nothing (they are then in the page cache, so the
    reader that loads them next does not wait on the disk); their total size. UnsafeFile when one is not a
    regular file or the whole read takes longer than `timeout_s`."""
    def read_all() -> int:
        fds: list[int] = []
        try:
            for p in paths:  # every one checked before any is read
                fds.append(open_regular(p))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        total = 0
        for fd in fds:
            with os.fdopen(fd, "rb") as f:
                while chunk := f.read(PREFETCH_CHUNK):
                    total += len(chunk)
        return total

    return _on_thread(read_all, timeout_s, f"reading {', '.join(p.name for p in paths)}")


PREFETCH_CHUNK = 16 << 20


def _read_fd(fd: int, limit: int | None) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read(-1 if limit is None else limit)


def _on_thread(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() on a daemon thread of its own, waited on for at most `timeout_s` (UnsafeFile past it: the
    thread is left to finish or hang alone)."""
    result: list[T | BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.append(exc)

    reader = threading.Thread(target=run, name="file-reader", daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result:
        raise UnsafeFile(f"{what} took longer than {timeout_s:g} s")
    value = result[0]
    if isinstance(value, BaseException):
        raise value
    return value
