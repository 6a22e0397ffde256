"""parallm: an MLX inference server for OpenAI-style applications and RL rollout loops.

The stage processes and the supervisor live in the top-level folders `stages/` and `launch/` of
the source tree and are installed as `parallm.stages` and `parallm.launch` (pyproject.toml's
package-dir; an editable install maps them the same way). A checkout used without installing it
(PYTHONPATH set to the checkout, as on the lent GPU machines) gets that same mapping of those two
names, and of no other folder, from the finder below.
"""

import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys

_CHECKOUT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_MAPPED = {"parallm.stages": "stages", "parallm.launch": "launch"}  # pyproject.toml's package-dir


class _CheckoutFinder(_abc.MetaPathFinder):
    """parallm.stages and parallm.launch from a checkout's stages/ and launch/ (tried after every other
    finder: an install's own copy or mapping wins)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's protocol
        folder = _MAPPED.get(fullname)
        if folder is None:
            return None
        where = _os.path.join(_CHECKOUT, folder)
        return _util.spec_from_file_location(fullname, _os.path.join(where, "__init__.py"),
                                             submodule_search_locations=[where])


if _os.path.isfile(_os.path.join(_CHECKOUT, "stages", "__main__.py")) and \
        not any(type(f).__name__ == "_CheckoutFinder" for f in _sys.meta_path):
    _sys.meta_path.append(_CheckoutFinder())
