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

DEFAULT_TIMEOUT_S = 30.0


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
    result: list[bytes | BaseException] = []

    def read() -> None:
        try:
            with os.fdopen(fd, "rb") as f:
                result.append(f.read(-1 if max_bytes is None else max_bytes + 1))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.append(exc)

    reader = threading.Thread(target=read, name="file-reader", daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result:
        raise UnsafeFile(f"reading {Path(path).name} took longer than {timeout_s:g} s")
    data = result[0]
    if isinstance(data, BaseException):
        raise data
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsafeFile(f"{Path(path).name} is larger than the limit of {max_bytes} bytes")
    return data
