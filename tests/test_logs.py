"""Log lines: text or JSON, the request id on every line about a request, the HTTP access log."""

from __future__ import annotations

import io
import json
import logging

from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.config import ServerConfig
from parallm.launch.process import _pump
from parallm.logs import JsonFormatter, TextFormatter, request_extra
from test_api_fakes import FakeBackend


def _record(msg: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord("parallm.x", logging.INFO, __file__, 1, msg, (), None)
    record.__dict__.update(extra)
    return record


def test_json_lines_carry_stage_request_id_and_fields():
    line = JsonFormatter("engine").format(_record("refused", **request_extra("cmpl-1", status=400)))
    out = json.loads(line)
    assert (out["stage"], out["request_id"], out["status"], out["message"], out["level"]) == \
        ("engine", "cmpl-1", 400, "refused", "info")


def test_text_lines_show_the_request_id():
    assert "INFO [cmpl-1] parallm.x: refused" in TextFormatter().format(_record("refused", request_id="cmpl-1"))
    assert "[" not in TextFormatter().format(_record("plain")).split("INFO")[1]


def test_access_log_names_method_route_status_and_request_id(caplog):
    client = TestClient(build_app(FakeBackend(), ServerConfig()), raise_server_exceptions=False)
    with caplog.at_level(logging.INFO, logger="parallm.access"):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        client.get("/v1/models/a/b", headers={"X-Request-Id": "mine-7"})
    rid = r.json()["id"]
    first, second = [rec for rec in caplog.records if rec.name == "parallm.access"]
    assert (first.request_id, first.route, first.status, first.method) == (rid, "/v1/completions", 200, "POST")
    assert (second.request_id, second.route, second.status) == ("mine-7", "/v1/models/{model}", 404)
    quiet = TestClient(build_app(FakeBackend(), ServerConfig(access_log=False)))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="parallm.access"):
        quiet.get("/v1/models")
    assert not [rec for rec in caplog.records if rec.name == "parallm.access"]


def test_the_supervisor_keeps_json_lines_json():
    stage_out = io.BytesIO(b'{"level": "info", "message": "hi"}\nTraceback (most recent call last):\n')
    out = io.StringIO()
    _pump(stage_out, "engine", out, json_lines=True)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["message"] == "hi" and lines[1] == {"level": "info", "stage": "engine", "logger": "output",
                                                       "message": "Traceback (most recent call last):"}
    out = io.StringIO()
    _pump(io.BytesIO(b"plain\n"), "engine", out, json_lines=False)
    assert out.getvalue() == "[engine] plain\n"


def test_lines_go_through_the_writer_thread_rendered_when_logged_with_their_exception(tmp_path):
    import subprocess
    import sys

    script = """
import logging, threading
from parallm.logs import request_extra, setup_logging
setup_logging("info", "ingress", "json")
log = logging.getLogger("parallm.x")
items = ["before"]
log.info("items %s", items, extra=request_extra("cmpl-9"))
items[0] = "after"
try:
    raise ValueError("boom")
except ValueError:
    log.exception("failed")
print(sorted(t.name for t in threading.enumerate()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    first, second = (json.loads(line) for line in done.stderr.splitlines())
    assert (first["message"], first["request_id"], first["stage"]) == ("items ['before']", "cmpl-9", "ingress")
    assert second["message"] == "failed" and "ValueError: boom" in second["exception"]
    assert "log-writer" in done.stdout


def test_lines_written_beside_the_writer_thread_stay_whole():
    """The supervisor's own lines (its ready line, the stages' relayed lines) share stderr with the
    log-writer thread: each must come out as a line of its own, never split by a record (a clean
    clone's e2e run once got the ready line and a log record on one JSON line)."""
    import subprocess
    import sys

    script = """
import json, logging, sys, threading
from parallm.logs import setup_logging, write_line
setup_logging("info", "supervisor", "json")
log = logging.getLogger("parallm.x")
def records():
    for i in range(3000):
        log.info("record %d", i)
t = threading.Thread(target=records)
t.start()
for i in range(3000):
    write_line(json.dumps({"message": "direct %d" % i}))
t.join()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    messages = [json.loads(line)["message"] for line in done.stderr.splitlines()]
    assert sorted(messages) == sorted([f"record {i}" for i in range(3000)] + [f"direct {i}" for i in range(3000)])
