"""The trainer stage: `parallm-train` supervised by `parallm-launch` (config `trainer.enabled`, or one
stage per enabled `[[trainer]]` entry: replica i runs config.enabled_trainers(config)[i]).

It is not on any request's path: the supervisor restarts it when it dies without telling clients
(no StageDown), and a trainer that finished its `rl_training.steps` (exit 0) stays finished. A
restarted trainer resumes from its latest checkpoint. Drain or shutdown stops it after the
current step, with a checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from parallm.client import ClientError
from parallm.config import Config, ModelConfig, enabled_trainers
from parallm.runtime import StageRuntime
from parallm.training.tasks import TaskError
from parallm.training.trainer import Trainer, TrainerError

log = logging.getLogger("parallm.trainer")


def main(config: Config, replica: int = 0) -> int:
    runtime = StageRuntime(config, "trainer", replica)
    tcfg = enabled_trainers(config)[replica]   # [trainer], then the [[trainer]] entries
    model = ModelConfig(path=tcfg.model.path or config.model.path, dtype=tcfg.model.dtype or config.model.dtype,
                        cache_dir=config.model.cache_dir, max_model_len=config.model.max_model_len)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def progress() -> None:
        runtime.heartbeat()

    def watch_control() -> None:
        while not stop.is_set():
            runtime.poll_control()
            if runtime.draining or runtime.shutting_down:
                stop.set()
            time.sleep(0.2)

    trainer = Trainer(tcfg, router=tcfg.server.router or runtime.addrs.router, model=model, name=tcfg.name,
                      stop=stop, progress=progress)
    try:
        trainer.setup()
    except (TrainerError, TaskError, ClientError, ValueError, OSError) as exc:
        runtime.fatal(f"trainer: {exc}")
        trainer.close()
        return 2
    runtime.ready({"adapter": trainer.adapter, "version": trainer.version, "step": trainer.step})
    threading.Thread(target=watch_control, name="control", daemon=True).start()
    try:
        return trainer.run()
    finally:
        trainer.close()
