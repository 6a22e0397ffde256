"""What every stage process shares: its link to the supervisor and dying with it.

A stage reports READY once it can serve, a heartbeat (with its stats) every
`supervisor.heartbeat_s`, and FATAL if it cannot start. It listens to the supervisor's
control channel for stage restarts, drain and shutdown. It exits when its supervisor dies:
the supervisor holds the write end of a pipe whose read end each stage watches, which works
on Linux and macOS alike (and PR_SET_PDEATHSIG is set too where Linux offers it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import zmq

from . import protocol
from .config import Config
from .keys import stage_curve
from .threads import name_os_thread
from .transport import Addresses, Receiver, Sender, addresses, open_socket, set_curve, set_max_message_bytes

log = logging.getLogger(__name__)


def die_with_parent(parent_fd: int | None) -> None:
    """Exit at once when the supervisor goes away, however it died."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent or os.getppid() == 1:
        os._exit(1)
    if parent_fd is None:
        return

    def watch() -> None:
        name_os_thread()
        try:
            while os.read(parent_fd, 1):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class StageRuntime:
    """A stage's sockets to the supervisor: READY / heartbeat / FATAL out, control messages in."""

    def __init__(self, config: Config, stage: str, replica: int = 0,
                 ctx: zmq.Context | None = None) -> None:
        self.config = config
        self.stage = stage
        self.replica = replica
        self.ctx = ctx or zmq.Context.instance()
        set_max_message_bytes(config.transport.max_message_mb << 20)
        set_curve(stage_curve(config.transport.curve_keys))
        self.addrs: Addresses = addresses(config)
        self._to_supervisor = Sender(open_socket(self.ctx, zmq.PUSH, self.addrs.supervisor, bind=False))
        sub = open_socket(self.ctx, zmq.SUB, self.addrs.control, bind=False)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.control = Receiver(sub, protocol.ControlMessage, name="control")
        self._interval = config.supervisor.heartbeat_s
        self._next_beat = 0.0
        self._in_flight = 0
        self._progress = time.monotonic()
        # an engine's (seconds its step in progress has run, that step's deadline): StepDeadline.progress
        self.step_progress: Callable[[], tuple[float, float]] | None = None
        self._beating = threading.Event()
        self._closed = threading.Event()  # close(): the heartbeat thread stops
        self.draining = False
        self.shutting_down = False

    def ready(self, info: dict[str, Any] | None = None) -> None:
        self._to_supervisor.send(protocol.Ready(stage=self.stage, replica=self.replica, pid=os.getpid(),
                                                info=info or {}))
        log.info("%s %d ready", self.stage, self.replica)

    def fatal(self, message: str) -> None:
        self._to_supervisor.send(protocol.Fatal(stage=self.stage, replica=self.replica, pid=os.getpid(),
                                                message=message))
        time.sleep(0.2)  # let the frame leave before the process exits

    def heartbeat(self, in_flight: Callable[[], int] | None = None, *, force: bool = False) -> None:
        """Called from the stage's loop: marks progress and, once per interval, refreshes what the
        stage holds in flight. The beat itself is sent by a thread (see `_beat`), so that a long MLX
        step (which releases the GIL) never reads as a dead stage; `loop_age_s` tells a stuck loop."""
        now = time.monotonic()
        self._progress = now
        if not force and now < self._next_beat:
            return
        self._next_beat = now + self._interval
        self._in_flight = in_flight() if in_flight else 0
        if not self._beating.is_set():
            self._beating.set()
            threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        elif force:
            self._send_beat(self._to_supervisor)

    def _send_beat(self, sender: Sender) -> None:
        step_age, deadline = self.step_progress() if self.step_progress is not None else (0.0, 0.0)
        sender.send(protocol.Heartbeat(stage=self.stage, replica=self.replica, pid=os.getpid(),
                                       loop_age_s=round(time.monotonic() - self._progress, 3),
                                       in_flight=self._in_flight, step_age_s=step_age, step_deadline_s=deadline),
                    block=False)

    def _beat(self) -> None:
        name_os_thread()
        sender = Sender(open_socket(self.ctx, zmq.PUSH, self.addrs.supervisor, bind=False))
        try:
            while not self._closed.is_set():
                self._send_beat(sender)
                self._closed.wait(self._interval)
        except zmq.ZMQError as error:
            ended = error.errno in (zmq.ETERM, zmq.ENOTSOCK)  # ctx.destroy() closes the socket under this thread
            if not (ended or self._closed.is_set() or self.ctx.closed):
                raise  # the socket failed while the stage runs: loud, as before
            # else the stage closed (or its context was destroyed, `closed` set only once it ends) between two beats
        finally:
            sender.close()

    def poll_control(self) -> list[Any]:
        """Control messages that arrived; Drain and Shutdown also set the flags."""
        messages = list(self.control.drain())
        for message in messages:
            if isinstance(message, protocol.Drain):
                self.draining = True
            elif isinstance(message, protocol.Shutdown):
                self.shutting_down = True
        return messages

    def close(self) -> None:
        self._closed.set()
        self._to_supervisor.close()
        self.control.close()
