"""Log lines of every process: plain text or one JSON object per line, with the request id on
every line about a request.

A line about a request passes `extra={"request_id": rid}` (use `request_extra(rid)`); both
formats show it, so one id can be followed from the ingress access log through the tokenizer
and the engine to the detokenizer with `grep` or a log pipeline's filter.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

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


def setup_logging(level: str, stage: str, fmt: LogFormat = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(stage) if fmt == "json" else TextFormatter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
