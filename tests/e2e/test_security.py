"""A local attacker's tries at the control plane of a real server (issue 22's regression tests)."""

from __future__ import annotations

import os
import stat
import time

import httpx
import msgpack
import pytest
import zmq

from parallm import protocol

from .server import Server

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-secret-0123456789"


@pytest.fixture(scope="module")
def keyed():
    with Server("--api-key", KEY, "--supervisor.restart-backoff-s", "0.2") as srv:
        yield srv


@pytest.mark.slow  # > 20 s on the 2-core CI host: make test's 10-minute budget
def test_the_run_dir_is_private_holds_no_secret_and_is_cleaned_at_exit():
    srv = Server("--api-key", KEY)
    srv.start()
    try:
        run = srv.run_dir
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
        names = sorted(os.listdir(run))
        assert "config.msgpack" not in names and "supervisor.pid" in names
        for name in names:
            path = os.path.join(run, name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name
            if not name.endswith(".sock"):
                assert KEY not in open(path, errors="ignore").read()
        assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)
    assert not [n for n in os.listdir(srv.run_dir) if n.endswith(".sock") or n == "supervisor.pid"]
    srv.stop()


def _deep_frame(kind: str) -> bytes:
    deep = b"\x81\xa1a" * 100_000 + b"\xc0"
    return msgpack.packb({"type": kind, "v": 2, "stage": "engine", "pid": 0, "stats": {}})[:-1] + deep


def test_a_frame_nested_100k_deep_on_every_socket_stops_nothing(keyed):
    pids = keyed.stage_pids()
    run = keyed.run_dir
    ctx = zmq.Context()
    try:
        for name, kind in (("engine", zmq.PUSH), ("tokenizer-0", zmq.PUSH), ("detok", zmq.PUSH),
                           ("supervisor", zmq.PUSH), ("training", zmq.PUSH), ("router", zmq.DEALER),
                           ("adapters", zmq.PUB)):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(f"ipc://{run}/{name}.sock")
            if kind == zmq.PUB:
                time.sleep(0.3)  # the SUB side learns of the new publisher
            for frame in (_deep_frame("heartbeat"), _deep_frame("submit"), b"\x81\xa1a" * 100_000 + b"\xc0"):
                sock.send(frame)
            sock.close()
    finally:
        ctx.term()
    time.sleep(2)
    assert keyed.proc.poll() is None, "the supervisor stopped"
    assert keyed.stage_pids() == pids, "a stage died or was restarted"
    r = httpx.post(f"{keyed.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text


def test_a_forged_heartbeat_restarts_no_stage(keyed):
    pids = keyed.stage_pids()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"ipc://{keyed.run_dir}/supervisor.sock")
    for pid in (0, 1, pids["engine"] + 1):
        sock.send(protocol.encode(protocol.Heartbeat(stage="engine", pid=pid, loop_age_s=1e9)))
        sock.send(protocol.encode(protocol.Fatal(stage="engine", pid=pid, message="forged")))
    sock.close()
    ctx.term()
    time.sleep(3)
    assert keyed.stage_pids() == pids and keyed.proc.poll() is None


@pytest.mark.slow  # 20 s, a server of its own: make test's 10-minute budget (clean clone, 2-core CI host)
def test_json_logs_follow_one_request_id_through_the_stages():
    """With --log-format json every output line is JSON, and a request's id is on the lines about it
    in ingress (the access log), the tokenizer (which refused it) and the detokenizer (which routed
    the error)."""
    import json

    with Server("--log-format", "json") as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "word " * 9000, "max_tokens": 4}, timeout=120)
        assert r.status_code == 400, r.text
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
        time.sleep(1.0)
        lines = [json.loads(line) for line in srv.lines if line.strip()]
    refused = [line for line in lines if line.get("request_id", "").startswith("cmpl-")
               and line["request_id"] not in (ok.json()["id"],)]
    assert {line["stage"] for line in refused} >= {"ingress", "tokenizer", "detokenizer"}, refused
    access = [line for line in lines if line.get("logger") == "parallm.access"]
    assert {(line["status"], line["route"]) for line in access} >= {(400, "/v1/completions"), (200, "/v1/completions")}


def test_adapter_paths_outside_the_roots_all_get_one_answer(keyed):
    """`/v1/adapters {"path"}` cannot tell an existing server path from a missing one."""
    answers = set()
    for path in ("/etc", "/etc/passwd", "/no/such/dir", keyed.run_dir):
        r = httpx.post(f"{keyed.url}/v1/adapters", headers={"Authorization": f"Bearer {KEY}"},
                       json={"name": "probe", "path": path}, timeout=60)
        assert r.status_code == 403, r.text
        answers.add(r.json()["error"]["message"].replace(repr(path), "PATH"))
    assert len(answers) == 1, answers


def test_raw_adapter_loads_by_path_cannot_probe_server_paths_either(keyed):
    """The raw client's AdapterPublish with a path (what `query adapter_load` was): one 403 for every
    path outside the roots, existing or not, from the engine stage itself."""
    from parallm.client import Client, ClientError

    answers = set()
    with Client(keyed.router, timeout=60) as client:
        for path in ("/etc", "/etc/passwd", "/no/such/dir", keyed.run_dir):
            with pytest.raises(ClientError) as info:
                client.load_adapter("probe", weights=path)
            assert (info.value.status, info.value.code) == (403, "adapter_path_not_allowed"), info.value
            answers.add(str(info.value).replace(repr(path), "PATH"))
        assert "probe" not in {a.name for a in client.list_adapters().adapters}
    assert len(answers) == 1, answers
