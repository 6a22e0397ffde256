"""The engine stage's adapter messages: where adapters and full-weight updates may be loaded from by path,
loading a published version, listing what is loaded, and the handlers of those messages (AdapterMessages,
a base of stages/engine.py's EngineStage)."""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from parallm import protocol
from parallm.adapters import AdapterError
from parallm.adapters.formats import allowed_path
from parallm.config import Config
from parallm.engine import Engine
from parallm.engine.weights import Applied, ChunkStaging, WeightsError
from parallm.stages.engine_reads import FileReads, adapter_files, weight_files
from parallm.stages.engine_replies import rejection
from parallm.transport import Sender

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
        engine.set_default_adapter(message.name)
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


class AdapterMessages:
    """The engine stage's handlers of adapter and full-weight messages. A load by path first has its files
    read on a reader thread (stages/engine_reads.py) while the loop keeps stepping; an inline version, an
    unload and a chunk of an update act at once. Every load happens between two steps."""

    config: Config
    engine: Engine
    out: Sender
    staging: ChunkStaging
    reads: FileReads[protocol.AdapterPublish | protocol.WeightsUpdate]
    reply: Callable[[protocol.Reply], None]  # EngineStage.reply

    def on_publish(self, message: protocol.AdapterPublish) -> None:
        if not message.path:
            self.publish(message)
            return
        try:
            path = allowed_path(message.path, adapter_roots(self.config))
        except AdapterError as exc:
            self.refuse_publish(message, exc)
            return
        self.reads.add(message, lambda: adapter_files(path))

    def publish(self, message: protocol.AdapterPublish) -> None:
        try:
            self.reply(load_adapter(self.engine, message, adapter_roots(self.config)))
        except AdapterError as exc:
            self.refuse_publish(message, exc)

    def refuse_publish(self, message: protocol.AdapterPublish, exc: AdapterError) -> None:
        log.warning("adapter %r version %d rejected: %s", message.name, message.version, exc.message)
        if message.qid and message.reply_to:
            self.out.send(rejection(message.qid, message.reply_to, exc))

    def take_reads(self) -> None:
        """Loads whose files were read go in now; a failed read is answered with its reason."""
        for message, error in self.reads.take():
            if isinstance(message, protocol.AdapterPublish):
                if error is None:
                    self.publish(message)
                else:
                    self.refuse_publish(message, AdapterError(f"cannot read the adapter: {error}",
                                                              code="invalid_adapter_file"))
            elif error is None:
                self.apply_weights(message)
            else:
                self.refuse_weights(message, WeightsError(error, code="invalid_weights"))

    def on_weights(self, message: protocol.WeightsUpdate) -> None:
        if not message.path:
            self.apply_weights(message)
            return
        try:
            path = weights_path(message.path, adapter_roots(self.config))
        except WeightsError as exc:
            self.refuse_weights(message, exc)
            return
        self.reads.add(message, lambda: weight_files(path))

    def apply_weights(self, message: protocol.WeightsUpdate) -> None:
        """Apply new base weights now (between two steps): a directory (its files already read) at once; the
        chunks of an update sent over PUB are checked and staged as they come (weights.ChunkStaging) and
        applied from the staging directory once the last is in, so generation goes on under the old weights
        meanwhile and an update that fails midway changes nothing (why is in the stats' `weights` and the log)."""
        try:
            if message.path:
                path = weights_path(message.path, adapter_roots(self.config))
                applied, complete = self.engine.update_weights(path=path, version=message.version), True
            else:
                staged = self.staging.add(message.update_id, message.chunk, message.chunks, message.weights,
                                          version=message.version, current_version=self.engine.weights_version)
                applied, complete = Applied(0, 0, 0.0), staged is not None
                if staged is not None:
                    try:
                        applied = self.engine.update_weights(path=str(staged.directory), version=staged.version)
                    except WeightsError as exc:
                        self.staging.done(exc)
                        raise
                    self.staging.done(version=self.engine.weights_version)
        except WeightsError as exc:
            self.refuse_weights(message, exc)
            return
        if complete:
            log.info("full-weight update: base model version %d (%d tensors, %d layers, %.1f ms)",
                     self.engine.weights_version, applied.tensors, applied.layers, applied.load_ms)
        self.reply(protocol.WeightsUpdated(qid=message.qid, reply_to=message.reply_to,
                                           version=self.engine.weights_version, tensors=applied.tensors,
                                           load_ms=applied.load_ms, complete=complete))

    def refuse_weights(self, message: protocol.WeightsUpdate, exc: WeightsError) -> None:
        log.warning("weight update rejected: %s", exc.message)
        if message.qid and message.reply_to:
            self.out.send(protocol.RequestError(rid=message.qid, reply_to=message.reply_to, status=exc.status,
                                                code=exc.code, message=exc.message))

    def expire_weights(self) -> None:
        """Drop a chunked update whose next chunk is overdue (adapters.weights_chunk_timeout_s); delete the
        staged chunks of applied updates once every rank serves them (a tensor-parallel group's other
        ranks confirm the weights version in their step digests: stats' `ranks`)."""
        error = self.staging.expire()
        if error is not None:
            log.warning("weight update rejected: %s", error.message)
        if self.staging.spent:
            ranks = self.engine.stats().ranks[1:]
            self.staging.sweep(lambda version: all(r.policy.get("", 0) >= version for r in ranks))

    def on_unload(self, message: protocol.AdapterUnload) -> None:
        try:
            removed = self.engine.unload_adapter(message.name)
        except AdapterError as exc:
            if message.qid and message.reply_to:
                self.out.send(rejection(message.qid, message.reply_to, exc))
            return
        self.reply(protocol.AdapterUnloaded(qid=message.qid, reply_to=message.reply_to, name=message.name,
                                            versions_removed=removed))
