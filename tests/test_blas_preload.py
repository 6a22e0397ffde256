"""What the engine's environment preloads on Linux CPU: OpenBLAS, and mimalloc unless told not to."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from parallm import blas
from parallm.config import Config, SupervisorConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or blas.find_openblas() is None,
                                reason="preloads apply to Linux with cmeel-openblas installed")


def preloads(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("LD_PRELOAD", "").split(":") if p]


def is_mimalloc(path: str) -> bool:
    return Path(path).name.startswith("libmimalloc.so")


def test_the_cpu_extra_installs_mimalloc_and_it_is_preloaded_first() -> None:
    mimalloc = blas.find_mimalloc()
    assert mimalloc is not None and mimalloc.exists()
    env = blas.openblas_env({"LD_PRELOAD": "/x/user.so"})
    assert preloads(env) == [str(mimalloc), str(blas.find_openblas()), "/x/user.so"]
    assert preloads(blas.openblas_env(env)) == preloads(env)  # applied twice, listed once


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_mimalloc_can_be_left_out_even_when_a_parent_preloaded_it(how: str) -> None:
    inherited = blas.openblas_env({"LD_PRELOAD": "/x/user.so"})
    if how == "argument":
        env = blas.openblas_env(inherited, allocator=False)
    else:
        env = blas.openblas_env({**inherited, blas.NO_MIMALLOC: "1"})
    assert not any(is_mimalloc(p) for p in preloads(env))
    assert preloads(env) == [str(blas.find_openblas()), "/x/user.so"]


def test_without_preloads_gives_back_what_the_user_had() -> None:
    env = blas.openblas_env({"LD_PRELOAD": "/x/user.so", "A": "1"})
    plain = blas.without_preloads(env)
    assert preloads(plain) == ["/x/user.so"] and plain["A"] == "1" and blas.MARK not in plain
    assert "LD_PRELOAD" not in blas.without_preloads(blas.openblas_env({}))


@pytest.mark.parametrize("choice, no_mimalloc_env, expected", [
    (None, None, True), (None, "1", False), ("system", None, False), ("mimalloc", "1", True)])
def test_the_supervisor_gives_the_engine_the_chosen_allocator(monkeypatch, choice, no_mimalloc_env, expected) -> None:
    from parallm.launch.supervisor import engine_environment

    if no_mimalloc_env is None:
        monkeypatch.delenv(blas.NO_MIMALLOC, raising=False)
    else:
        monkeypatch.setenv(blas.NO_MIMALLOC, no_mimalloc_env)
    env = engine_environment(Config(supervisor=SupervisorConfig(blas="openblas", allocator=choice)))
    assert str(blas.find_openblas()) in preloads(env)
    assert any(is_mimalloc(p) for p in preloads(env)) is expected


def test_this_test_process_computes_with_mimalloc_loaded() -> None:
    """conftest re-executes pytest with the engine's preloads, so every engine test here runs on
    the allocator the served engine gets."""
    if os.environ.get(blas.NO_MIMALLOC):
        pytest.skip("PARALLM_NO_MIMALLOC is set")
    maps = Path("/proc/self/maps").read_text()
    assert str(blas.find_mimalloc()) in maps and str(blas.find_openblas()) in maps
