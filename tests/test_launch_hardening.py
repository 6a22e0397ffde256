"""The supervisor's own defences: its run directory, and messages it must not believe."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from parallm import protocol
from parallm.config import Config, build_config
from parallm.launch import rundir
from parallm.launch.process import StageProcess, StageSpec
from parallm.launch.supervisor import StartupError, Supervisor


def test_run_dir_is_private_and_removed_when_the_supervisor_made_it(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.tempfile, "tempdir", str(tmp_path))
    made = rundir.RunDir()
    assert stat.S_IMODE(os.stat(made.path).st_mode) == 0o700
    pid_file = os.path.join(made.path, rundir.PID_FILE)
    assert stat.S_IMODE(os.stat(pid_file).st_mode) == 0o600 and open(pid_file).read() == str(os.getpid())
    made.close()
    assert not os.path.exists(made.path)


def test_a_given_run_dir_that_does_not_exist_is_created_private_and_removed(tmp_path):
    given = tmp_path / "a" / "run"
    run = rundir.RunDir(str(given))
    assert run.created and stat.S_IMODE(os.stat(given).st_mode) == 0o700
    (given / "engine.sock").write_text("")
    run.close()
    assert not given.exists() and (tmp_path / "a").exists()


def test_a_shared_or_non_empty_run_dir_is_refused_untouched(tmp_path):
    """Issue 30: --transport.run-dir at an existing directory chmodded it to 0700 and, at exit, deleted other
    programs' sockets in it (a foreign other-app.sock was removed). Now it is refused, unchanged."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(PermissionError, match="open to other users"):
        rundir.RunDir(str(shared))
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755 and not list(shared.iterdir())
    busy = tmp_path / "busy"
    busy.mkdir(mode=0o700)
    (busy / "other-app.sock").write_text("")
    (busy / "keep.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match="not empty"):
        rundir.RunDir(str(busy))
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt", "other-app.sock"]
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere-private")
    (tmp_path / "nowhere-private").mkdir(mode=0o700)
    with pytest.raises(NotADirectoryError):
        rundir.RunDir(str(link))
    # the supervisor turns each into a startup error naming the directory
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(shared)}})
    with pytest.raises(StartupError, match="shared.*open to other users"):
        Supervisor(config)._prepare()


def test_an_empty_private_run_dir_is_used_and_only_the_servers_files_removed(tmp_path):
    given = tmp_path / "run"
    given.mkdir(mode=0o700)
    run = rundir.RunDir(str(given))
    assert not run.created
    for name in ("engine.sock", "server.key", "engine-0-ring.json", "other-app.txt"):
        (given / name).write_text("")
    run.close()
    assert sorted(p.name for p in given.iterdir()) == ["other-app.txt"]


def test_what_a_dead_supervisor_left_in_a_given_run_dir_is_reused_not_a_live_ones(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    given = tmp_path / "run"
    given.mkdir(mode=0o700)
    (given / "engine.sock").write_text("")
    (given / rundir.PID_FILE).write_text(str(dead.pid))
    run = rundir.RunDir(str(given))
    assert sorted(p.name for p in given.iterdir()) == [rundir.PID_FILE]
    with pytest.raises(FileExistsError, match="in use by the supervisor"):
        rundir.RunDir(str(given))
    run.close()


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


def _stage(name: str, pid: int) -> StageProcess:
    """The supervisor's record of a stage whose process is `pid` (never started here)."""
    return StageProcess(StageSpec(name), proc=object(), pid=pid)


@pytest.mark.parametrize("message", [
    protocol.Heartbeat(stage="engine", pid=0, loop_age_s=1e9),          # pid 0 (was believed)
    protocol.Heartbeat(stage="engine", pid=4242, loop_age_s=1e9),       # another process
    protocol.Ready(stage="engine", pid=4242),
    protocol.Fatal(stage="engine", pid=0, message="forged"),
    protocol.Heartbeat(stage="nosuch", pid=1000),
])
def test_messages_not_from_the_stages_own_process_are_ignored(message):
    sup = Supervisor(Config())
    engine = _stage("engine", 1000)
    sup.stages = [engine]
    sup._handle(message)
    assert (engine.last_beat, engine.loop_age_s, engine.ready) == (0.0, 0.0, False)


def test_the_stages_own_messages_are_believed():
    sup = Supervisor(Config())
    engine = _stage("engine", 1000)
    sup.stages = [engine]
    sup._handle(protocol.Heartbeat(stage="engine", pid=1000, loop_age_s=2.5, in_flight=3, step_age_s=1.0,
                                   step_deadline_s=6.0))
    assert (engine.loop_age_s, engine.in_flight) == (2.5, 3) and engine.last_beat > 0
    assert engine.step_due == pytest.approx(engine.last_beat + 5.0)  # a tensor-parallel step's deadline
    with pytest.raises(StartupError, match="boom"):
        sup._handle(protocol.Fatal(stage="engine", pid=1000, message="boom"))
