"""The supervisor's own defences: its run directory, and messages it must not believe."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from parallm import protocol
from parallm.config import Config
from parallm.launch import rundir
from parallm.launch.process import StageSpec
from parallm.launch.supervisor import StartupError, Supervisor


def test_run_dir_is_private_and_removed_when_the_supervisor_made_it(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.tempfile, "tempdir", str(tmp_path))
    made = rundir.RunDir()
    assert stat.S_IMODE(os.stat(made.path).st_mode) == 0o700
    pid_file = os.path.join(made.path, rundir.PID_FILE)
    assert stat.S_IMODE(os.stat(pid_file).st_mode) == 0o600 and open(pid_file).read() == str(os.getpid())
    made.close()
    assert not os.path.exists(made.path)


def test_a_given_run_dir_is_made_private_and_only_our_files_are_removed(tmp_path):
    given = tmp_path / "run"
    given.mkdir(mode=0o755)
    (given / "keep.txt").write_text("the user's")
    (given / "engine.sock").write_text("")
    run = rundir.RunDir(str(given))
    assert stat.S_IMODE(os.stat(given).st_mode) == 0o700
    run.close()
    assert sorted(p.name for p in given.iterdir()) == ["keep.txt"]


def test_stale_run_dirs_of_dead_supervisors_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live, foreign = tmp_path / "parallm-stale", tmp_path / "parallm-live", tmp_path / "parallm-nopid"
    for d in (stale, live, foreign):
        d.mkdir()
    (stale / rundir.PID_FILE).write_text(str(dead.pid))
    (live / rundir.PID_FILE).write_text(str(os.getpid()))
    assert rundir.sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and foreign.exists()


def test_sockets_bound_in_the_run_dir_are_owner_only(tmp_path):
    import zmq

    from parallm.transport import open_socket

    ctx = zmq.Context()
    sock = open_socket(ctx, zmq.PULL, f"ipc://{tmp_path}/x.sock", bind=True)
    assert stat.S_IMODE(os.stat(tmp_path / "x.sock").st_mode) == 0o600
    sock.close(0)
    ctx.term()


class _Stage:
    def __init__(self, name: str, pid: int) -> None:
        self.spec = StageSpec(name)
        self.pid, self.proc, self.ready, self.restarts = pid, object(), False, 0
        self.last_beat, self.loop_age_s, self.in_flight = 0.0, 0.0, 0


@pytest.mark.parametrize("message", [
    protocol.Heartbeat(stage="engine", pid=0, loop_age_s=1e9),          # pid 0 (was believed)
    protocol.Heartbeat(stage="engine", pid=4242, loop_age_s=1e9),       # another process
    protocol.Ready(stage="engine", pid=4242),
    protocol.Fatal(stage="engine", pid=0, message="forged"),
    protocol.Heartbeat(stage="nosuch", pid=1000),
])
def test_messages_not_from_the_stages_own_process_are_ignored(message):
    sup = Supervisor(Config())
    engine = _Stage("engine", 1000)
    sup.stages = [engine]
    sup._handle(message)
    assert (engine.last_beat, engine.loop_age_s, engine.ready) == (0.0, 0.0, False)


def test_the_stages_own_messages_are_believed():
    sup = Supervisor(Config())
    engine = _Stage("engine", 1000)
    sup.stages = [engine]
    sup._handle(protocol.Heartbeat(stage="engine", pid=1000, loop_age_s=2.5, in_flight=3))
    assert (engine.loop_age_s, engine.in_flight) == (2.5, 3) and engine.last_beat > 0
    with pytest.raises(StartupError, match="boom"):
        sup._handle(protocol.Fatal(stage="engine", pid=1000, message="boom"))
