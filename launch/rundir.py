"""The supervisor's run directory: where the stages' ipc sockets live.

It is private to the user who runs the server (0700; every socket in it 0600) and holds no secret:
the configuration, API keys included, reaches each stage through a pipe, never a file. A run
directory the supervisor made itself is removed when it exits; one it finds left behind by a
supervisor that died (its `supervisor.pid` names no live process) is removed at start. A given
directory that already exists is used only when it is empty and private, and only the server's own
files are removed from it.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger("parallm.supervisor")

PREFIX = "parallm-"
PID_FILE = "supervisor.pid"
# what a server makes in its run dir: this pid file, ipc sockets, the fresh CURVE server key's public half
# (parallm.keys.SERVER_PUBLIC_FILE), tensor-parallel rank groups' host files (group.py)
SERVER_FILES = (PID_FILE, "*.sock", "server.key", "engine-*-ring.json")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def sweep_stale(parent: str | None = None) -> list[str]:
    """Remove this user's run directories under `parent` (the temp dir) whose supervisor is dead."""
    root = Path(parent or tempfile.gettempdir())
    removed = []
    for path in root.glob(PREFIX + "*"):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            pid = int((path / PID_FILE).read_text().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    if removed:
        log.info("removed %d run dir(s) left by supervisors that died: %s", len(removed), ", ".join(removed))
    return removed


class RunDir:
    """A private run directory: `path` to use, `close()` to clean up what this supervisor made.

    A given path that does not exist is created (0700) and removed at exit. One that exists must be
    an empty directory of this user that only this user can open (as `mktemp -d` makes): it is not
    chmodded, and at exit only the files the server makes in it (SERVER_FILES) are removed. Anything
    else (a shared directory, one holding other programs' files) is refused: the server would
    otherwise change its mode or delete what is not its own."""

    def __init__(self, given: str = "") -> None:
        self.created = True
        if not given:
            sweep_stale()
            self.path = tempfile.mkdtemp(prefix=PREFIX)  # mode 0700
        else:
            self.path = os.path.abspath(given)
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                os.mkdir(self.path, 0o700)  # atomic: fails if anything is there already
                os.chmod(self.path, 0o700)  # the umask does not narrow it further than asked
            except FileExistsError:
                self.created = False
                _check_given(self.path)
        pid_file = os.path.join(self.path, PID_FILE)
        fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))

    def close(self) -> None:
        """Remove the directory if this supervisor made it, else only the files the server makes in it."""
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for entry in Path(self.path).iterdir():
            if _server_file(entry.name):
                try:
                    entry.unlink()
                except OSError:
                    pass


def _check_given(path: str) -> None:
    """An existing run dir is used only as found: a real directory of this user, private, empty."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"run dir {path} exists and is not a directory")
    if info.st_uid != os.getuid():
        raise PermissionError(f"run dir {path} belongs to another user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(f"run dir {path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                              "give a path that does not exist yet (it is created private) or an empty 0700 "
                              "directory")
    names = os.listdir(path)
    if names and all(_server_file(name) for name in names) and PID_FILE in names:
        pid = _pid_in(os.path.join(path, PID_FILE))
        if pid and _alive(pid):
            raise FileExistsError(f"run dir {path} is in use by the supervisor with pid {pid}")
        for name in names:  # left by a supervisor that died: its own files only
            os.unlink(os.path.join(path, name))
        log.info("removed %d file(s) left in run dir %s by a supervisor that died", len(names), path)
    elif names:
        raise FileExistsError(f"run dir {path} is not empty; give a path that does not exist yet (it is "
                              "created private) or an empty 0700 directory")


def _server_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in SERVER_FILES)


def _pid_in(path: str) -> int:
    try:
        return int(Path(path).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0
