"""Stand-ins for the two modules mlx_vlm.server (0.7.10) imports at start but never calls on the chat path
perf/bench_vision drives, for a machine that cannot install them (the GPU machine: no registry, and one
upload of at most 64 MiB, which .gpu/b's MLX CUDA wheel nearly fills):

- `mlx_audio.audio_io` (read, write): the /v1/audio/* routes (mlx_vlm/server/audio.py). The mlx-audio
  wheel is 2.4 MB.
- `cryptography.fernet` (Fernet, InvalidToken): the Responses API's context compaction
  (mlx_vlm/server/compaction.py). The cryptography wheel is 4.7 MB.

Each is written only where the real module does not import; calling into a stand-in raises, so a
benchmark that reached one would fail loudly rather than measure something else.

    python -m perf.vlm_server_standins /tmp/vlmsite    # then put /tmp/vlmsite on mlx_vlm.server's PYTHONPATH
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_MESSAGE = "{what} is a stand-in here (perf/vlm_server_standins.py): install {package} to use it"

_AUDIO_IO = f'''"""Stand-in for mlx-audio's audio_io (perf/vlm_server_standins.py)."""


def read(*args, **kwargs):
    raise RuntimeError("{_MESSAGE.format(what="mlx_audio.audio_io.read", package="mlx-audio")}")


def write(*args, **kwargs):
    raise RuntimeError("{_MESSAGE.format(what="mlx_audio.audio_io.write", package="mlx-audio")}")
'''

_FERNET = f'''"""Stand-in for cryptography.fernet (perf/vlm_server_standins.py)."""


class InvalidToken(Exception):
    pass


class Fernet:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("{_MESSAGE.format(what="cryptography.fernet.Fernet", package="cryptography")}")

    @staticmethod
    def generate_key():
        raise RuntimeError("{_MESSAGE.format(what="cryptography.fernet.Fernet", package="cryptography")}")
'''

_PACKAGE = '"""Stand-in package (perf/vlm_server_standins.py)."""\n'

STANDINS: dict[str, dict[str, str]] = {
    "mlx_audio.audio_io": {"mlx_audio/__init__.py": _PACKAGE, "mlx_audio/audio_io.py": _AUDIO_IO},
    "cryptography.fernet": {"cryptography/__init__.py": _PACKAGE, "cryptography/fernet.py": _FERNET},
}


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


def write(target: Path) -> list[str]:
    """Write a stand-in under `target` for each module that does not import; the modules written."""
    written = []
    for module, files in STANDINS.items():
        if importable(module):
            continue
        for name, text in files.items():
            path = target / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        written.append(module)
    return written


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path, help="the directory put first on mlx_vlm.server's PYTHONPATH")
    written = write(parser.parse_args().target)
    print(f"stand-ins: {', '.join(written) or 'none (the real modules import)'}", file=sys.stderr)


if __name__ == "__main__":
    main()
