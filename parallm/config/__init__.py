"""One typed configuration for every stage: defaults < TOML file < PARALLM_* env < CLI.

The supervisor builds a `Config` once and hands it to each stage as encoded bytes, so every
process sees exactly the same values; stages never read the environment for settings.
Each field's `Meta(description=...)` is its documentation and its `--help` text.

A setting decided for the machine when it is not given has one spelling of "automatic": unset
(None). On the command line, in the environment and in a TOML file the word `auto` unsets it.
The engine resolves its unset settings once, where it starts (`resolve_engine_config`), and
reports what it chose in its stats.

- schema.py: the structs, their defaults and the engine's resolution of unset settings (the trainer's structs:
  trainer_schema.py; fields.py: how a field is described);
- loading.py: building a Config from a file, the environment and the command line, and its checks.
"""

from .loading import *  # noqa: F401,F403 - the package's face: every public name of both
from .loading import __all__ as _loading
from .schema import *  # noqa: F401,F403
from .schema import __all__ as _schema

__all__ = [*_schema, *_loading]
