"""parallm: an MLX inference server for OpenAI-style applications and RL rollout loops.

The stage processes and the supervisor live in the top-level folders `stages/` and `launch/` of
the source tree and are installed as `parallm.stages` and `parallm.launch` (pyproject.toml). A
checkout used without installing it (PYTHONPATH set to the checkout, as on the lent GPU machines)
has them beside this package instead of inside it; they resolve there too.
"""

import os as _os

_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "stages", "__main__.py")) and \
        not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "stages")):
    __path__.append(_checkout)  # type: ignore[name-defined]  # noqa: F821 - a package's own __path__
