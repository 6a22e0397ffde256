"""perf/ stands on its own (nothing there imports tests/), every benchmark script parses its
arguments, and the harness names results files by benchmark, experiment and device."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from perf import harness

PERF = Path(__file__).resolve().parents[1] / "perf"
# the runnable scripts (perf/harness.py and helpers such as parallel_adapters.py are imported by them)
SCRIPTS = sorted(p.stem for p in PERF.glob("*.py") if p.stem not in ("__init__", "harness")
                 and "__name__ == \"__main__\"" in p.read_text())
DEVICE = r"(?:cpu|g?[ah]\d{2,3}|l4\d?s?|g?b\d00|rtx-\d+|apple-m\d+(?:-pro|-max|-ultra)?)"  # harness.device_slug's
RESULT_NAME = re.compile(rf"^[a-z0-9.]+(-[a-z0-9.]+)*-{DEVICE}\.(json|md|png|log)$")


def test_nothing_in_perf_imports_tests():
    pattern = re.compile(r"^\s*(from|import)\s+(tests|e2e)\b|sys\.path\.\w+\(.*tests", re.M)
    offenders = [p.name for p in PERF.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


# Runs each script as `python -m perf.<script> --help` would, all in one process: each script's own
# process spent ~1.5 s importing MLX and the rest, 36 times.
HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
seen = {}
for script in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [f"perf/{script}.py", "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(f"perf.{script}", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            code, _ = 1, traceback.print_exc()
    seen[script] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-c", HELP_RUNNER, *SCRIPTS], cwd=PERF.parent, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_help(script, helps):
    run = helps[script]
    assert run["code"] == 0, run["stderr"][-2000:]
    assert "usage:" in run["stdout"]


def test_results_files_follow_the_naming_rule():
    names = [p.name for p in (PERF / "results").iterdir() if p.is_file()]
    assert names and [n for n in names if not RESULT_NAME.match(n)] == []
    assert [n for n in names if re.search(r"-(run|host)\d|-[0-9a-f]{7}-", n)] == []


BENCHMARKS = ("serving", "engine", "rl", "train", "adapters", "gpu", "served-profile", "decode-profile",
              "launch-settings", "compiled-pass", "fastmath", "mixed-passes", "step", "stage-loop")


def cited_results(text: str) -> set[str]:
    """Results file names (globs allowed, `name.{json,md}` expanded) cited in `text`, except older
    runs cited as `git show COMMIT:perf/results/NAME`."""
    cited = re.compile(rf"(?<![:\w-])((?:{'|'.join(BENCHMARKS)})[-*][\w.*-]*?)"
                       r"\.(\{[a-z,]+\}|json|md|png|log|\*)(?![\w-])")
    text = re.sub(r"git show \w+:perf/results/\S+", "", text)
    return {f"{m.group(1)}.{ext}" for m in cited.finditer(text) for ext in m.group(2).strip("{}").split(",")}


def test_docs_cite_results_files_that_exist():
    """Every results file the docs name is in perf/results (older runs are cited as `git show C:path`)."""
    root = PERF.parent
    texts = {doc.name: doc.read_text() for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]}
    texts["perf/README.md"] = (PERF / "README.md").read_text().split("## Where the files merged")[0]
    missing = sorted(f"{doc}: {name}" for doc, text in texts.items() for name in cited_results(text)
                     if not any((PERF / "results").glob(name)))
    assert missing == []


def test_cited_results_reads_the_forms_the_docs_use():
    text = ("`serving-cpu.{md,json}` and `perf/results/step-cpu.json`, `compiled-pass*-h100.json`, older "
            "`git show a1449bc:perf/results/serving-cpu-run2.md`; perf/bench_serving.py; `gpu-llama-3.2-3b-h100.json`")
    assert cited_results(text) == {"serving-cpu.md", "serving-cpu.json", "step-cpu.json", "compiled-pass*-h100.json",
                                   "gpu-llama-3.2-3b-h100.json"}


@pytest.mark.parametrize("gpu, slug", [("", "cpu"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
                                       ("Apple M2 Max", "apple-m2-max")])
def test_device_slug(gpu, slug):
    assert harness.device_slug({"gpu": gpu}) == slug


def test_results_path_and_record(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "machine", lambda: {"gpu": "NVIDIA H100 80GB HBM3", "cpus": 16})
    results = harness.Results("gpu", "llama-3.2-3b", tmp_path, argv=["--shape", "llama-3.2-3b"])
    assert results.json == tmp_path / "gpu-llama-3.2-3b-h100.json"  # the shape's dots are no suffix
    assert results.png == tmp_path / "gpu-llama-3.2-3b-h100.png"
    assert results.previous() == {}
    results.write({"runs": [1], "command": "stale"}, "# table")
    record = results.previous()
    assert list(record)[:2] == ["command", "machine"] and record["runs"] == [1]
    assert record["command"].endswith("--shape llama-3.2-3b") and record["machine"]["cpus"] == 16
    assert results.md.read_text() == "# table\n"
    assert harness.Results("serving", "", tmp_path).json.name == "serving-h100.json"
    ab = harness.Results("serving", "", tmp_path, out=tmp_path / "ab" / "base-1.json")  # --out: exactly there
    assert (ab.json, ab.md) == (tmp_path / "ab" / "base-1.json", tmp_path / "ab" / "base-1.md")


def test_server_env_puts_the_checkout_first_and_drops_preloads(monkeypatch):
    from parallm import blas

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv(blas.MARK, "/x/libopenblas.so")
    monkeypatch.setenv("LD_PRELOAD", "/x/libopenblas.so")
    env = harness.server_env()
    assert env["PYTHONPATH"].split(":") == [str(harness.ROOT), "/elsewhere"]
    assert "LD_PRELOAD" not in env and blas.MARK not in env
    given = harness.server_env({"LD_PRELOAD": "/x/libopenblas.so"})
    assert given["LD_PRELOAD"] == "/x/libopenblas.so"  # an environment given is kept as it is


def test_process_reports_a_server_that_exits_before_ready():
    proc = harness.Process([sys.executable, "-c", "print('starting'); raise SystemExit(3)"], ready="never",
                           ready_timeout=30)
    with pytest.raises(RuntimeError, match="exited with 3") as info:
        proc.start()
    assert "starting" in str(info.value)


def test_process_is_ready_on_its_line_and_stops(tmp_path):
    script = "import time; print('warming'); print('ready now', flush=True); time.sleep(60)"
    with harness.Process([sys.executable, "-c", script], ready="ready now", ready_timeout=30) as proc:
        assert proc.proc.poll() is None and proc.lines[:2] == ["warming", "ready now"]
    assert proc.proc.returncode is not None
