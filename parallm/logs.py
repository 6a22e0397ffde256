"""Log lines of every process: plain text or one JSON object per line, with the request id on
every line about a request.

A line about a request passes `extra={"request_id": rid}` (use `request_extra(rid)`); both
formats show it, so one id can be followed from the ingress access log through the tokenizer
and the engine to the detokenizer with `grep` or a log pipeline's filter.

A stage's stderr is a pipe its supervisor drains; a write to it blocks the writing thread while the
pipe is full or the CPU is busy, and the thread that logs is the stage's loop (the ingress event
loop writes one access line per request). So lines are formatted and written by a thread of their
own (`log-writer`): the loop only renders the message and queues the record.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import sys
import threading
import time
from logging.handlers import QueueHandler, QueueListener
from typing import IO, Any, Literal

from .threads import name_os_thread

LogFormat = Literal["text", "json"]
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def request_extra(rid: str, **fields: Any) -> dict[str, Any]:
    """The `extra=` of a log call about request `rid` (with any other structured fields)."""
    return {"request_id": rid, **fields}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, stage, logger, message, the record's extra fields."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "stage": self.stage, "logger": record.name,
            "message": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """`time level logger: message`, with `[request_id]` after the level when the line has one."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        line = super().format(record)
        if rid:
            head, sep, rest = line.partition(f" {record.name}: ")
            line = f"{head} [{rid}]{sep}{rest}"
        return line


class _Enqueue(QueueHandler):
    """Queues a record for the writer thread with its message rendered now (its arguments may change
    later); the exception, if any, is formatted there."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg, record.args = record.getMessage(), None
        return record


class _Writer(QueueListener):
    def _monitor(self) -> None:
        threading.current_thread().name = "log-writer"
        name_os_thread()
        super()._monitor()


_writer: _Writer | None = None


def _stop_writer() -> None:
    """Write what is queued and stop the writer thread (at exit, or before logging is set up again)."""
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None


def write_line(line: str, stream: IO[str] | None = None) -> None:
    """Write `line` to `stream` (stderr) whole beside the log-writer thread's lines: `print` writes
    its text and its newline in two calls, between which that thread may write a record (a JSON
    log line then holds two objects), so the line goes in one write under the writer's handler lock."""
    stream = stream if stream is not None else sys.stderr
    handler = _writer.handlers[0] if _writer is not None and _writer.handlers else None
    if handler is not None:
        handler.acquire()
    try:
        stream.write(line + "\n")
        stream.flush()
    finally:
        if handler is not None:
            handler.release()


def setup_logging(level: str, stage: str, fmt: LogFormat = "text", *, background: bool = True) -> None:
    """Log to stderr as `fmt`; with `background`, through the log-writer thread (see the module docstring)."""
    global _writer
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(stage) if fmt == "json" else TextFormatter())
    _stop_writer()
    if background:
        lines: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        _writer = _Writer(lines, handler)
        _writer.start()
        atexit.unregister(_stop_writer)
        atexit.register(_stop_writer)
        handler = _Enqueue(lines)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
