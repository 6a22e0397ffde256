"""One supervised child process: started with a parent-death pipe and its config through a pipe,
its output prefixed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from parallm.logs import write_line


@dataclass
class StageSpec:
    name: str
    replica: int = 0
    env: dict[str, str] | None = None

    @property
    def label(self) -> str:
        numbered = self.name == "tokenizer" or (self.name == "trainer" and self.replica)  # several trainers
        return f"{self.name}-{self.replica}" if numbered else self.name


def _write_all(fd: int, data: bytes) -> None:
    """Write `data` to a pipe and close it (a thread: a config larger than the pipe buffer must not
    block the supervisor until the stage reads it)."""
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:  # the stage died before reading it: its exit is handled like any other
        pass


def _pump(stream: IO[bytes], label: str, out: IO[str], json_lines: bool) -> None:
    """Copy a stage's output to ours: each line prefixed `[label]`, or with JSON logs, the stage's
    JSON lines as they are and anything else (a traceback C code printed) wrapped in one."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if not json_lines:
            write_line(f"[{label}] {line}", out)
        elif line.startswith("{") and line.endswith("}"):
            write_line(line, out)
        else:
            write_line(json.dumps({"level": "info", "stage": label, "logger": "output", "message": line}), out)
    stream.close()


class ChildProcess:
    """What the supervisor asks of a process it started (`proc`): a local stage, or the ssh process
    that stands for a rank on another machine (launch/remote_rank.py)."""

    proc: subprocess.Popen | None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclass
class StageProcess(ChildProcess):
    """A running (or dead) stage and its restart bookkeeping."""

    spec: StageSpec
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_beat: float = 0.0
    ready: bool = False
    pid: int = 0
    loop_age_s: float = 0.0         # how long its loop has been in one iteration, as its last heartbeat said
    in_flight: int = 0              # what it still holds, as its last heartbeat said
    step_due: float = 0.0           # an engine's step in progress must end by then (monotonic; 0: none)
    step_deadline_s: float = 0.0    # that step's deadline, as its last heartbeat said
    last_step_deadline_s: float = 0.0  # the deadline of the last step any heartbeat was inside
    next_restart_at: float = 0.0
    backoff: float = 0.0
    finished: bool = False          # an off-path stage (the trainer) that exited 0: done, not restarted

    def start(self, config: bytes, parent_read_fd: int, log_out: IO[str], json_logs: bool = False) -> None:
        """Start the stage; its configuration (API keys included) goes through a pipe, never a file."""
        config_read, config_write = os.pipe()
        cmd = [sys.executable, "-m", "parallm.stages", self.spec.name, "--replica", str(self.spec.replica),
               "--config-fd", str(config_read), "--parent-fd", str(parent_read_fd)]
        env = dict(self.spec.env or os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                         pass_fds=(parent_read_fd, config_read), start_new_session=True)
        except OSError:
            os.close(config_write)
            raise
        finally:
            os.close(config_read)
        threading.Thread(target=_write_all, args=(config_write, config), daemon=True,
                         name=f"config-{self.spec.label}").start()
        self.pid = self.proc.pid
        self.started_at = self.last_beat = time.monotonic()
        self.ready = False
        self.loop_age_s = 0.0
        self.in_flight = 0
        self.step_due = self.step_deadline_s = self.last_step_deadline_s = 0.0
        threading.Thread(target=_pump, args=(self.proc.stdout, self.spec.label, log_out, json_logs),
                         daemon=True, name=f"log-{self.spec.label}").start()

    def heard_step(self, step_age_s: float, step_deadline_s: float, now: float) -> None:
        """A heartbeat said the engine's step in progress (a tensor-parallel group's) has run `step_age_s`
        of its `step_deadline_s` (0: between steps): it must end by `now - step_age_s + step_deadline_s`.
        An engine (rank 0) that falls silent keeps the last due time: a stopped one is caught by the same
        deadline. Between steps while it holds requests (`in_flight`, set from the same heartbeat) its next
        step starts at once, so it is due by `now` plus the deadline of the last step heard of: the
        heartbeat thread beats on while the loop is busy between steps (an adapter or weight load), so only
        an engine stopped between two steps falls silent past it (before, only supervisor.dead_after_s's
        silence caught that one)."""
        if step_deadline_s > 0:
            self.last_step_deadline_s = step_deadline_s
            self.step_deadline_s = step_deadline_s
            self.step_due = now - step_age_s + step_deadline_s
        elif self.in_flight and self.last_step_deadline_s:
            self.step_deadline_s = self.last_step_deadline_s
            self.step_due = now + self.last_step_deadline_s
        else:
            self.step_deadline_s = self.step_due = 0.0

    def overdue_s(self, now: float) -> float:
        """How far past its deadline the step in progress is (0 when it is not, or none runs)."""
        return max(0.0, now - self.step_due) if self.step_due else 0.0

    def terminate(self, timeout: float) -> None:
        if not self.alive():
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
