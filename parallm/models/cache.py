"""Where converted models live, and how a model directory is written so nobody sees half of one.

A directory is built in a temporary sibling, fsynced, and renamed into place. The rename is
atomic, so the target either does not exist or is complete: a conversion killed half-way leaves
only a temporary directory, which the next builder removes. Builders of the same target take an
exclusive `flock` first, so two processes starting together convert once and both end with the
same complete directory (and if the lock is not honoured, the loser of the rename discards its
copy and uses the winner's).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

# Part of every cache key: bump it when the layout of converted directories changes, so that
# directories written by an older parallm are rebuilt instead of misread.
FORMAT_VERSION = "1"


def cache_root(configured: str = "") -> Path:
    """`configured` (ModelConfig.cache_dir) or the user cache dir: $XDG_CACHE_HOME/parallm or ~/.cache/parallm."""
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "parallm"


def file_key(path: Path, *extra: str) -> str:
    """A short key for a source file: its name, size and mtime (cheap, and changes when it is replaced)."""
    st = path.stat()
    text = "\0".join([FORMAT_VERSION, path.name, str(st.st_size), str(st.st_mtime_ns), *extra])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextmanager
def _exclusive(lock_path: Path, what: str) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is writing %s", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def ensure_dir(target: Path, build: Callable[[Path], None]) -> bool:
    """Make `target` exist, complete, by calling `build(tmp_dir)` unless it already does.

    Returns True when this call built it. `build` fills the empty directory it is given; if it
    raises, nothing is left behind and the exception propagates.
    """
    if target.is_dir():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{target.name}.lock", str(target)):
        if target.is_dir():
            return False
        for stale in target.parent.glob(_tmp_prefix(target) + "*"):
            # Under the lock no live builder owns one of these: a killed process left it.
            log.info("removing %s, left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target), dir=target.parent))
        try:
            build(tmp)
            _fsync_tree(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # lost a race the lock did not prevent
                return False
            _fsync_dir(target.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True
