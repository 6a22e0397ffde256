"""parallm.files: files a client names are read only when they are regular files, with a timeout."""

from __future__ import annotations

import os
import threading
import time

import pytest

from parallm.files import UnsafeFile, check_regular, read_regular


def test_a_fifo_a_device_and_a_directory_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "adapters.safetensors"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    for path in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(UnsafeFile, match="not a regular file"):
            read_regular(path)
        with pytest.raises(UnsafeFile):
            check_regular(path)
    assert time.monotonic() - t0 < 1.0


def test_a_regular_file_is_read_whole_and_bounded(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 1000)
    assert read_regular(path) == b"x" * 1000
    assert read_regular(path, max_bytes=1000) == b"x" * 1000
    with pytest.raises(UnsafeFile, match="limit"):
        read_regular(path, max_bytes=999)
    link = tmp_path / "link"
    link.symlink_to(path)
    assert read_regular(link) == b"x" * 1000


def test_a_read_that_hangs_ends_at_the_timeout(tmp_path, monkeypatch):
    """A regular file on a mount that stopped answering: simulated by a read that blocks."""
    import parallm.files as files

    gate = threading.Event()
    real_fdopen = os.fdopen

    class Stuck:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            gate.wait(10)
            return self.f.read(n)

    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: Stuck(real_fdopen(fd, mode)))
    path = tmp_path / "w.bin"
    path.write_bytes(b"y")
    t0 = time.monotonic()
    with pytest.raises(UnsafeFile, match="longer than 0.2 s"):
        read_regular(path, timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0
    gate.set()


def test_an_adapter_directory_whose_weights_are_a_fifo_is_refused(tmp_path):
    from parallm.adapters import AdapterError
    from parallm.adapters.formats import read_dir

    (tmp_path / "adapter_config.json").write_text("{}")
    os.mkfifo(tmp_path / "adapters.safetensors")
    with pytest.raises(AdapterError) as err:
        read_dir(tmp_path)
    assert err.value.code == "invalid_adapter_file" and "not a regular file" in err.value.message
    assert str(tmp_path) not in err.value.message
