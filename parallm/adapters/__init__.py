"""LoRA / DoRA adapters: formats, validation, the versioned registry, per-row application.

See docs/adapters.md. The engine owns one AdapterManager; nothing here touches sockets.
"""

from .errors import AdapterError
from .formats import ModuleLoRA, ParsedAdapter, parse, read_dir
from .policy import HeldRequests, VersionPolicy
from .registry import AdapterManager, LoadedAdapter
from .safetensors_io import load_bytes, save_bytes

__all__ = ["AdapterError", "AdapterManager", "HeldRequests", "LoadedAdapter", "ModuleLoRA", "ParsedAdapter",
           "VersionPolicy", "load_bytes", "parse", "read_dir", "save_bytes"]
