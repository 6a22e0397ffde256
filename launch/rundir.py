"""The supervisor's run directory: where the stages' ipc sockets live.

It is private to the user who runs the server (0700; every socket in it 0600) and holds no secret:
the configuration, API keys included, reaches each stage through a pipe, never a file. A run
directory the supervisor made itself is removed when it exits; one it finds left behind by a
supervisor that died (its `supervisor.pid` names no live process) is removed at start.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("parallm.supervisor")

PREFIX = "parallm-"
PID_FILE = "supervisor.pid"


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
    """A private run directory: `path` to use, `close()` to clean up what this supervisor made."""

    def __init__(self, given: str = "") -> None:
        self.created = not given or not os.path.exists(given)
        if not given:
            sweep_stale()
            self.path = tempfile.mkdtemp(prefix=PREFIX)  # mode 0700
        else:
            self.path = os.path.abspath(given)
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            if os.stat(self.path).st_uid != os.getuid():
                raise PermissionError(f"run dir {self.path} belongs to another user")
        os.chmod(self.path, 0o700)
        pid_file = os.path.join(self.path, PID_FILE)
        fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))

    def close(self) -> None:
        """Remove the directory if this supervisor made it, else only the sockets and pid file in it."""
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for entry in Path(self.path).iterdir():
            if entry.name == PID_FILE or entry.suffix == ".sock":
                try:
                    entry.unlink()
                except OSError:
                    pass
