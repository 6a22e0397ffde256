"""The supervisor's messages: what a stage tells it (Ready, Heartbeat, Fatal), and what it tells every
stage on the control channel (a stage down or up again, drain, shutdown)."""

from __future__ import annotations

from typing import Any, Union

from .base import Message

__all__ = ["Ready", "Heartbeat", "Fatal", "StageDown", "StageUp", "Drain", "Shutdown", "SupervisorInbound",
           "ControlMessage"]


class Ready(Message, tag="ready"):
    stage: str
    replica: int = 0
    pid: int = 0
    info: dict[str, Any] = {}


class Heartbeat(Message, tag="heartbeat"):
    """A stage is alive; `loop_age_s` is how long its loop has been in one iteration (a stuck loop
    is restarted) and `in_flight` what it still holds (the supervisor drains until it is 0). An engine
    (a tensor-parallel group's rank 0) also says how long its step in progress has run (`step_age_s`)
    and the deadline it gave that step (`step_deadline_s`; 0: between steps): past it the engine (a
    rank) hangs, and it (the group) is restarted (parallm/engine/step_deadline.py)."""

    stage: str
    replica: int = 0
    pid: int = 0
    loop_age_s: float = 0.0
    in_flight: int = 0
    step_age_s: float = 0.0
    step_deadline_s: float = 0.0


class Fatal(Message, tag="fatal"):
    """A stage cannot run (e.g. the model does not load); the supervisor stops with this message."""

    stage: str
    replica: int = 0
    pid: int = 0
    message: str = ""


class StageDown(Message, tag="stage_down"):
    stage: str
    replica: int = 0
    restarts: int = 0


class StageUp(Message, tag="stage_up"):
    stage: str
    replica: int = 0
    restarts: int = 0


class Drain(Message, tag="drain"):
    deadline: float


class Shutdown(Message, tag="shutdown"):
    pass


SupervisorInbound = Union[Ready, Heartbeat, Fatal]
"""What the supervisor's PULL socket accepts."""
ControlMessage = Union[StageDown, StageUp, Drain, Shutdown]
"""What every stage's control SUB socket accepts."""
