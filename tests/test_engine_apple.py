"""Apple silicon paths with the device query stubbed (no Mac here): the wired memory limit is set
to Metal's recommended working set as mlx-lm does, the KV budget is a share of that working set
minus the weights, and the Linux-only paths (/proc/meminfo, the OpenBLAS/mimalloc preloads) are
never taken on a Mac."""

import builtins

import mlx.core as mx
import pytest

from parallm import blas
from parallm.engine import memory

from _engine_helpers import make_engine, tiny_model

GiB = 1 << 30


@pytest.fixture
def metal(monkeypatch):
    """MLX as it answers on a Mac with a 48 GiB recommended working set; records wired limits."""
    wired = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 48 * GiB,
                                                     "memory_size": 64 * GiB})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: wired.append(n) or 0)
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    return wired


def test_metal_budget_is_the_working_set_minus_weights_and_reads_no_proc(metal, monkeypatch):
    real_open = builtins.open

    def no_proc(path, *a, **kw):
        assert not str(path).startswith("/proc"), f"a Mac read {path}"
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert memory.auto_kv_budget_bytes(weight_bytes=8 * GiB) == int(40 * GiB * memory.METAL_KV_FRACTION)
    assert memory.auto_kv_budget_bytes(weight_bytes=60 * GiB) == 64 << 20  # weights beyond it: the floor
    assert memory.set_wired_limit() == 48 * GiB and metal == [48 * GiB]


def test_engine_on_metal_wires_the_working_set_and_sizes_the_kv_from_it(metal, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)  # the tiny model still computes on the CPU
    small = 256 << 20  # a small working set: the test allocates what the budget says
    monkeypatch.setattr(memory, "metal_working_set", lambda: small)
    engine = make_engine(model, kv_budget_bytes=0, prefix_cache=False)
    assert metal == [small]
    assert engine.kv_budget_bytes == int((small - memory.weight_bytes(model)) * memory.METAL_KV_FRACTION)


def test_linux_only_preloads_are_skipped_on_a_mac(monkeypatch):
    monkeypatch.setattr(blas.platform, "system", lambda: "Darwin")
    assert blas.openblas_env({"PATH": "/usr/bin"}) is None


def test_off_metal_nothing_is_wired(monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: called.append(n))
    assert memory.metal_working_set() is None and memory.set_wired_limit() is None and not called
