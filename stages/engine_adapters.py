"""The engine stage's adapter messages: where adapters and full-weight updates may be loaded from by path,
loading a published version and listing what is loaded (stages/engine.py handles the messages)."""

from __future__ import annotations

import logging
import time
from typing import Sequence

from parallm import protocol
from parallm.adapters import AdapterError
from parallm.adapters.formats import allowed_path
from parallm.config import Config
from parallm.engine import Engine
from parallm.engine.weights import WeightsError

log = logging.getLogger("parallm.engine.stage")


def adapter_roots(config: Config) -> list[str]:
    """Where adapters and full-weight updates may be loaded from by path: adapters.allowed_dirs, else the
    model's directory, the trainer's checkpoints and the directories of the adapters loaded at start
    (adapters.preload)."""
    preloaded = [entry.partition("=")[2] for entry in config.adapters.preload if "=" in entry]
    return list(config.adapters.allowed_dirs) or [config.model.path, config.trainer.checkpointing.dir,
                                                   *(t.checkpointing.dir for t in config.trainers), *preloaded]


def weights_path(path: str, roots: Sequence[str]) -> str:
    """A full-weight update's directory, resolved, when it lies under `roots` (WeightsError 403 otherwise,
    the same answer whether the path exists or not, as for adapters)."""
    try:
        return allowed_path(path, roots)
    except AdapterError as exc:
        raise WeightsError(exc.message.replace("adapter path", "weights path"), status=exc.status,
                           code="weights_path_not_allowed") from None


def load_adapter(engine: Engine, message: protocol.AdapterPublish,
                 roots: Sequence[str] | None = None) -> protocol.AdapterLoaded:
    """Load a published version (raises AdapterError, changing nothing). A path outside `roots` is
    refused (None: any path, for in-process callers)."""
    t0 = time.perf_counter()
    path = allowed_path(message.path, roots) if message.path and roots is not None else message.path
    adapter = engine.load_adapter(message.name, config=message.config, weights=message.weights or None,
                                  path=path, format=message.format, version=message.version)
    if message.make_default:
        engine.adapters.set_default(message.name)
    ms = 1000 * (time.perf_counter() - t0)
    log.info("adapter %s version %d loaded (%s, rank %d, %d modules, %.1f ms)%s", message.name, adapter.version,
             adapter.kind, adapter.rank, len(adapter.modules), ms, "; it is the default policy now"
             if message.make_default else "")
    return protocol.AdapterLoaded(qid=message.qid, reply_to=message.reply_to, name=message.name,
                                  version=adapter.version, bytes=adapter.nbytes, load_ms=ms, merged=adapter.merged,
                                  default=engine.adapters.default_name == message.name)


def adapter_list(engine: Engine, qid: str = "", reply_to: bytes = b"") -> protocol.AdapterList:
    return protocol.AdapterList(qid=qid, reply_to=reply_to, adapters=engine.adapters.describe(),
                                policy={**engine.policy(), "": engine.weights_version},
                                adapter_bytes=engine.adapters.nbytes,
                                default_adapter=engine.adapters.default_name)
