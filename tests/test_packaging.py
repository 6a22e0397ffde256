"""The installed distribution: its name, its import names, and what serving pulls in."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "parallm").rglob("__init__.py")}
    found |= set(mapped)
    assert found == listed, f"pyproject's packages list differs from the folders: {sorted(found ^ listed)}"
    assert mapped == {"parallm.stages": "stages", "parallm.launch": "launch"}


def test_stages_and_launch_import_only_under_parallm() -> None:
    code = ("import importlib.util as u, parallm.stages.engine, parallm.launch.cli; "
            "print(u.find_spec('stages'), u.find_spec('launch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.split() == ["None", "None"], out.stdout


def test_a_checkout_without_install_maps_stages_and_launch_and_no_other_folder() -> None:
    """PYTHONPATH=checkout with no install (the GPU machines): parallm.stages and parallm.launch come
    from the checkout's folders; other top-level folders (perf/, tests/) do not become parallm.*."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]; "
            "import importlib.util as u, parallm.stages.tokenizer, parallm.launch.cli; "
            "print(parallm.stages.__file__, parallm.launch.__file__, u.find_spec('parallm.perf'), "
            "u.find_spec('parallm.tests'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == [str(ROOT / "stages" / "__init__.py"), str(ROOT / "launch" / "__init__.py"),
                                  "None", "None"], out.stdout + out.stderr


def test_distribution_name_and_entry_points() -> None:
    dist = metadata.distribution("parallm-mlx")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts["parallm-launch"] == "parallm.launch.cli:main"
    assert scripts["parallm-train"] == "parallm.training.cli:main"


def test_serving_requirements_hold_no_test_or_plot_packages() -> None:
    serving = " ".join(PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["cpu"])
    for name in ("pytest", "matplotlib", "hypothesis", "openai"):
        assert name not in serving, f"{name} is installed for serving"
    makefile = (ROOT / "Makefile").read_text()
    serve_rule = makefile.split("$(VENV)/.serve:")[1].split("\n\n")[0]
    assert "-e '.[cpu]'" in serve_rule and ",test" not in serve_rule and "perf" not in serve_rule
