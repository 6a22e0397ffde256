"""Thread names and the stage thread sampler (parallm/threads.py), and perf/profile_threads' readings."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from parallm import threads
from perf.profile_threads import thread_table, threads_of
from perf.pyspy import parse_dump, parse_raw

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")


def _parked(ready: threading.Event, stop: threading.Event) -> None:
    threads.name_os_thread()
    ready.set()
    stop.wait(10)


@linux
def test_a_thread_names_itself_for_the_os_and_the_proc_reader_sees_it():
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=_parked, args=(ready, stop), name="parked-worker-long-name", daemon=True)
    thread.start()
    ready.wait(5)
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm") as f:
            assert f.read().strip() == "parked-worker-l"  # the kernel keeps 15 bytes
        seen = threads_of(os.getpid())
        name, cpu, switches = seen[thread.native_id]
        assert name == "parked-worker-l" and cpu >= 0.0 and switches >= 1
        assert os.getpid() in seen  # the main thread
    finally:
        stop.set()


def test_the_sampler_counts_where_each_python_thread_stands_and_writes_it(tmp_path):
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=_parked, args=(ready, stop), name="parked", daemon=True)
    thread.start()
    ready.wait(5)
    try:
        sampler = threads.ThreadSampler(tmp_path / "engine-1.json")
        for _ in range(3):
            sampler.sample()
        sampler.write()
    finally:
        stop.set()
    data = json.loads((tmp_path / "engine-1.json").read_text())
    assert data["samples"] == 3 and data["pid"] == os.getpid()
    parked = next(t for t in data["threads"].values() if t["name"] == "parked")
    assert parked["tid"] == thread.native_id and parked["samples"] == 3
    assert any("wait" in where for where in parked["frames"])


def test_the_sampler_is_off_without_its_variable(monkeypatch):
    monkeypatch.delenv(threads.ENV_DIR, raising=False)
    assert threads.start_sampler("engine") is None


def test_py_spy_raw_lines_become_samples_per_thread_and_their_innermost_frames():
    raw = ("thread (11): MainThread;run (engine.py:404);decode (runner.py:280) 30\n"
           "thread (11): MainThread;run (engine.py:404);poll (poll.py:106) 10\n"
           "thread (12): heartbeat;_beat (runtime.py:118) 2\n")
    parsed = parse_raw(raw, top=1)
    assert parsed["samples"] == {"thread (11): MainThread": 40, "thread (12): heartbeat": 2}
    assert parsed["top"]["thread (11): MainThread"] == {"decode (runner.py:280)": 30}


def test_thread_table_gives_each_thread_its_cpu_over_the_run_and_names_the_main_thread():
    before = {"engine": {100: ("python3", 1.0, 10), 101: ("ZMQbg/IO/0", 0.5, 7)}}
    after = {"engine": {100: ("python3", 3.0, 30), 101: ("ZMQbg/IO/0", 0.7, 407), 102: ("python3", 0.4, 5)}}
    table = thread_table({"engine": 100}, before, after, wall=2.0, tokens=100, py_names={102: "heartbeat"})
    engine = table["engine"]
    assert engine["cpu_s"] == pytest.approx(2.6) and engine["cpu_ms_per_token"] == pytest.approx(26.0)
    assert [(r["name"], r["cpu_s"]) for r in engine["threads"]] == [("main", 2.0), ("heartbeat", 0.4),
                                                                    ("ZMQbg/IO/0", 0.2)]
    assert engine["threads"][0]["cpu_pct_of_wall"] == 100.0
    assert [r["switches_per_token"] for r in engine["threads"]] == [0.2, 0.05, 4.0]


def test_py_spy_dumps_become_each_threads_frames_innermost_first():


    text = ('Process 7: python -m parallm.stages engine\nPython v3.12.3\n\n'
            'Thread 7 (active): "MainThread"\n    cudaEventSynchronize (libcudart.so.13)\n'
            '    tolist (runner.py:29)\nThread 9 (idle): "heartbeat"\n    clock_nanosleep (libc.so.6)\n')
    assert parse_dump(text) == {"7 MainThread (active)": ["cudaEventSynchronize (libcudart.so.13)", "tolist (runner.py:29)"],
                                "9 heartbeat (idle)": ["clock_nanosleep (libc.so.6)"]}


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux
def test_a_background_worker_runs_below_the_thread_that_started_it_and_leaves_that_one_alone():
    """Issue 30: work for requests not running yet (a grammar compiling, a large prompt tokenizing) took cores from
    the engine's step; ten nice levels lower, the step's threads get the core back as soon as they wake."""
    from concurrent.futures import ThreadPoolExecutor

    mine = _nice()
    with ThreadPoolExecutor(1, initializer=threads.background_worker) as pool:
        theirs = pool.submit(_nice).result(5)
    assert theirs == min(19, mine + threads.BACKGROUND_NICE) and _nice() == mine


def test_lowering_is_left_alone_where_nice_is_not_per_thread(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")  # there setpriority would lower the whole process
    assert threads.lower_priority() is False
