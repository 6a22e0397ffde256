"""Model specs: MLX directories, offline hub ids, and conversions that are atomic and run once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from parallm.config import ModelConfig
from parallm.models import ModelLoadError, load_model, resolve_model
from parallm.models.resolve import converted_dir

from models_synth import CONFIGS, build_model, write_gguf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, "llama", CONFIGS["llama"], build_model(CONFIGS["llama"]), "F16")
    return path


@pytest.fixture(scope="module")
def tiny_dir(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model(ModelConfig(path=str(tiny_gguf), cache_dir=str(cache)), progress=False).path


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_mlx_directory_is_used_in_place(tmp_path: Path, tiny_dir: Path) -> None:
    model_dir = copy_model(tiny_dir, tmp_path / "my-model")
    source = resolve_model(ModelConfig(path=str(model_dir)))
    assert (source.path, source.name, source.model_type) == (model_dir, "my-model", "llama")
    assert resolve_model(ModelConfig(path=str(model_dir), served_name="tiny")).name == "tiny"
    loaded = load_model(ModelConfig(path=str(model_dir), max_model_len=128))
    assert loaded.max_model_len == 128 and loaded.dtype == "float32"


def test_mlx_directory_missing_files_are_listed(tmp_path: Path, tiny_dir: Path) -> None:
    model_dir = copy_model(tiny_dir, tmp_path / "m")
    for name in ("tokenizer.json", "model.safetensors"):
        (model_dir / name).unlink()
    with pytest.raises(ModelLoadError) as err:
        resolve_model(ModelConfig(path=str(model_dir)))
    message = str(err.value)
    assert "model*.safetensors" in message
    assert "a tokenizer (tokenizer.json or tokenizer.model or vocab.json+merges.txt or tiktoken.model)" in message
    assert "found: config.json" in message


def test_unsupported_model_type_is_refused(tmp_path: Path, tiny_dir: Path) -> None:
    model_dir = copy_model(tiny_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "plamo3"}))
    with pytest.raises(ModelLoadError, match=r"model_type 'plamo3' is not served: mlx-lm's plamo3 masks"):
        load_model(ModelConfig(path=str(model_dir)))


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model.path is empty"):
        resolve_model(ModelConfig(path=" "))
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model(ModelConfig(path=str(tmp_path / "nowhere")))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a directory nor a .gguf file"):
        resolve_model(ModelConfig(path=str(tmp_path / "weights.bin")))
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        from parallm.models.dtype import apply_dtype
        apply_dtype(build_model(CONFIGS["llama"]), "int8")


def _hub(tmp_path: Path, tiny_dir: Path, repo: str = "models--org--tiny", commit: str = "abc123") -> Path:
    hub = tmp_path / "hub"
    copy_model(tiny_dir, hub / repo / "snapshots" / commit)
    (hub / repo / "refs").mkdir()
    (hub / repo / "refs" / "main").write_text(commit)
    return hub


def test_hub_id_from_local_cache(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _hub(tmp_path, tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    source = resolve_model(ModelConfig(path="org/tiny"))
    assert (source.path, source.name) == (hub / "models--org--tiny" / "snapshots" / "abc123", "org/tiny")
    assert resolve_model(ModelConfig(path="org/tiny@abc123")).path == source.path
    assert load_model(ModelConfig(path="org/tiny")).vocab_size == CONFIGS["llama"]["vocab_size"]
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "hub").rename(tmp_path / "hub-moved")
    (tmp_path / "hub-moved").rename(tmp_path / "hub")  # HF_HOME/hub is the cache
    assert resolve_model(ModelConfig(path="org/tiny")).path == source.path


def test_hub_id_missing(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _hub(tmp_path, tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        resolve_model(ModelConfig(path="org/absent"))
    assert str(hub / "models--org--absent") in str(err.value) and "nothing is downloaded" in str(err.value)
    with pytest.raises(ModelLoadError, match="revision 'nope' is not in the local cache.*cached snapshots: abc123"):
        resolve_model(ModelConfig(path="org/tiny@nope"))
    partial = hub / "models--org--partial" / "snapshots" / "def456"
    partial.mkdir(parents=True)
    shutil.copy(tiny_dir / "config.json", partial / "config.json")
    with pytest.raises(ModelLoadError) as err:
        resolve_model(ModelConfig(path="org/partial"))
    assert "missing model*.safetensors (the weights); a tokenizer (tokenizer.json or" in str(err.value)


def test_hub_id_not_cached_is_downloaded_with_its_revision(tmp_path: Path, tiny_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's snapshot_download stands in for the network (none here): it fills the
    cache layout as the real one does; a cached revision is never downloaded again."""
    import huggingface_hub

    hub = _hub(tmp_path, tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None):
        calls.append((repo_id, revision, cache_dir))
        if repo_id == "org/private":
            raise OSError("401 Client Error: access to org/private is restricted")
        snap = Path(cache_dir) / ("models--" + repo_id.replace("/", "--")) / "snapshots" / "fff999"
        copy_model(tiny_dir, snap)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert resolve_model(ModelConfig(path="org/tiny")).path.name == "abc123" and not calls
    source = resolve_model(ModelConfig(path="org/fresh@v2"))
    assert calls == [("org/fresh", "v2", str(hub))]
    assert source.path == hub / "models--org--fresh" / "snapshots" / "fff999" and source.name == "org/fresh"
    with pytest.raises(ModelLoadError, match="downloading it failed: OSError: 401"):
        resolve_model(ModelConfig(path="org/private"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        resolve_model(ModelConfig(path="org/other"))
    assert len(calls) == 2


def test_interrupted_conversion_leaves_no_model(tmp_path: Path, tiny_gguf: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(path=str(tiny_gguf), cache_dir=str(tmp_path / "cache"))
    target = converted_dir(tiny_gguf, config.cache_dir)

    def half_written(path: str, arrays: dict, metadata: dict | None = None) -> None:
        Path(path).write_bytes(b"\0" * 4096)
        raise RuntimeError("interrupted mid-write")

    monkeypatch.setattr(mx, "save_safetensors", half_written)
    with pytest.raises(RuntimeError, match="interrupted mid-write"):
        resolve_model(config, progress=False)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if p.suffix != ".lock"] == []
    monkeypatch.undo()
    assert resolve_model(config, progress=False).path == target
    assert load_model(config).vocab_size == CONFIGS["llama"]["vocab_size"]


def _child(script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARALLM_NO_OPENBLAS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killed_conversion_is_cleaned_up(tmp_path: Path, tiny_gguf: Path) -> None:
    """A converter killed by SIGKILL while writing leaves only a temporary directory; the next
    resolve removes it and converts."""
    killed = _child("""
        import os, signal, sys
        import mlx.core as mx
        from pathlib import Path
        from parallm.config import ModelConfig
        from parallm.models import resolve_model
        def die(path, arrays, metadata=None):
            Path(path).write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        mx.save_safetensors = die
        resolve_model(ModelConfig(path=sys.argv[1], cache_dir=sys.argv[2]), progress=False)
    """, str(tiny_gguf), str(tmp_path / "cache"))
    assert killed.wait(timeout=60) == -9
    target = converted_dir(tiny_gguf, str(tmp_path / "cache"))
    leftovers = [p for p in target.parent.iterdir() if ".tmp-" in p.name]
    assert not target.exists() and len(leftovers) == 1
    source = resolve_model(ModelConfig(path=str(tiny_gguf), cache_dir=str(tmp_path / "cache")), progress=False)
    assert source.path == target and not leftovers[0].exists()


def test_concurrent_conversions_convert_once(tmp_path: Path, tiny_gguf: Path) -> None:
    script = """
        import json, sys, time
        from pathlib import Path
        from parallm.config import ModelConfig
        from parallm.models import resolve as r
        calls = []
        convert = r.convert_gguf
        r.convert_gguf = lambda *a, **k: (calls.append(1), convert(*a, **k))
        Path(sys.argv[3]).touch()
        while not all(Path(p).exists() for p in sys.argv[4:]):
            time.sleep(0.002)
        source = r.resolve_model(ModelConfig(path=sys.argv[1], cache_dir=sys.argv[2]), progress=False)
        print(json.dumps({"path": str(source.path), "converted": len(calls)}))
    """
    ready = [str(tmp_path / f"ready-{i}") for i in range(2)]
    children = [_child(script, str(tiny_gguf), str(tmp_path / "cache"), ready[i], *ready) for i in range(2)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["path"] == results[1]["path"]
    assert sorted(r["converted"] for r in results) == [0, 1]
    assert load_model(ModelConfig(path=results[0]["path"])).dtype == "float32"


def test_loader_refuses_what_the_engine_refuses_by_type() -> None:
    from parallm.engine.compat import REFUSED_MODEL_TYPES, refusal_for_type

    assert all(refusal_for_type(t) for t in REFUSED_MODEL_TYPES)
    assert refusal_for_type("qwen3_moe") is None
