"""Hugging Face hub ids: from the local hub cache first, else downloaded with huggingface_hub
where the network allows (HF_HUB_OFFLINE=1 forbids it; HF_TOKEN is read by huggingface_hub).

The cache layout (huggingface_hub's, read directly so that the package is not needed):
`<cache>/models--<org>--<name>/refs/<revision>` holds a commit hash, and
`<cache>/models--<org>--<name>/snapshots/<commit>/` holds the files (links into `blobs/`).
The cache is $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")


def looks_like_hub_id(spec: str) -> bool:
    """`org/name` or `org/name@revision`, and not an existing local path."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _download_hint(repo_id: str) -> str:
    return (f"download it where there is network access (`hf download {repo_id}`) into that cache, "
            f"or pass a local model directory")


def snapshot_dir(spec: str) -> Path:
    """The cached snapshot directory for `org/name[@revision]` (revision: a branch, tag or commit)."""
    repo_id, _, revision = spec.partition("@")
    revision = revision or "main"
    cache = hub_cache_dir()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        raise ModelLoadError(
            f"'{repo_id}' is not in the local Hugging Face cache: {repo_dir} does not exist "
            f"(cache from HF_HUB_CACHE / HF_HOME); {_download_hint(repo_id)}")
    snapshots = repo_dir / "snapshots"
    available = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif revision in available:
        commit = revision
    elif revision == "main" and len(available) == 1:
        commit = available[0]  # a cache filled without refs (e.g. copied by hand)
    else:
        raise ModelLoadError(
            f"'{repo_id}': revision '{revision}' is not in the local cache ({ref} is missing); "
            f"cached snapshots: {', '.join(available) or 'none'} (pick one with '{repo_id}@<commit>')")
    snapshot = snapshots / commit
    if not snapshot.is_dir():
        raise ModelLoadError(f"'{repo_id}@{revision}' points to commit {commit}, but {snapshot} is missing; "
                             f"{_download_hint(repo_id)}")
    return snapshot


OFFLINE_VALUES = ("1", "true", "yes", "on")

# what serving needs from a model repository (no PyTorch .bin/.pt weights, no images)
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.py"]


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in OFFLINE_VALUES


def fetch_snapshot(spec: str) -> Path:
    """The snapshot directory of `org/name[@revision]`: the local cache's if it holds that
    revision, else downloaded through huggingface_hub (revision honoured, HF_TOKEN used by it)
    unless HF_HUB_OFFLINE is set."""
    try:
        return snapshot_dir(spec)
    except ModelLoadError as cached:
        if hub_offline():
            raise ModelLoadError(f"{cached} (HF_HUB_OFFLINE is set, so nothing is downloaded)") from None
        repo_id, _, revision = spec.partition("@")
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ModelLoadError(f"{cached}; huggingface_hub is not installed, so it cannot be downloaded") from None
        try:
            path = snapshot_download(repo_id, revision=revision or None, cache_dir=str(hub_cache_dir()),
                                     allow_patterns=DOWNLOAD_PATTERNS)
        except Exception as exc:  # noqa: BLE001 - network, authentication, unknown repo or revision
            raise ModelLoadError(f"'{spec}' is not in the local Hugging Face cache and downloading it failed: "
                                 f"{type(exc).__name__}: {exc}") from None
        return Path(path)
