"""`parallm-train`: GRPO with LoRA against a running parallm server.

    parallm-train --config train.toml --router tcp://127.0.0.1:5552

Standalone it needs the server's ZeroMQ router address (`server.router`); `parallm-launch` with
`trainer.enabled = true` starts it as a supervised stage instead (stages/trainer.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Sequence

from parallm.config import ConfigError, ModelConfig, TrainerConfig, add_cli_options, build_trainer_config, cli_overrides

DESCRIPTION = """Train a LoRA adapter with GRPO on rollouts from a running parallm server, publishing
every new version to it. Settings come from a TOML file (--config: a trainer file or a parallm-launch
file with a [trainer] section), PARALLM_TRAINER__* environment variables and the options below."""


def parse(argv: Sequence[str] | None = None) -> TrainerConfig:
    parser = argparse.ArgumentParser(prog="parallm-train", description=DESCRIPTION)
    parser.add_argument("--config", metavar="FILE", help="TOML file")
    add_cli_options(parser, TrainerConfig, env_prefix="PARALLM_TRAINER__",
                    aliases={"router": "server.router", "steps": "rl_training.steps", "task": "rl_training.task"},
                    add_config=False)
    namespace = parser.parse_args(argv)
    try:
        config = build_trainer_config(file=namespace.config, cli=cli_overrides(namespace, TrainerConfig))
    except ConfigError as exc:
        parser.error(str(exc))
    if not config.server.router:
        parser.error("the server's router address is needed: --router tcp://HOST:PORT (or server.router in the "
                     "file; parallm-launch prints it when ready)")
    if bool(config.server.curve_server_key) != bool(config.server.curve_client_key):
        parser.error("give both --server.curve-server-key and --server.curve-client-key (CURVE over tcp://), or "
                     "neither")
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = parse(argv)
    from parallm import blas

    blas.reexec_with_openblas()
    logging.basicConfig(level=getattr(logging, config.log_level.upper()), stream=sys.stderr,
                        format="[trainer] %(asctime)s %(levelname)s %(message)s")
    from .trainer import Trainer, TrainerError
    from .tasks import TaskError

    if config.server.curve_server_key:
        from parallm.keys import CurveKeyError, client_curve
        from parallm.transport import set_curve

        try:  # every socket of this process: the client's, the adapter publisher's, the rollout subscriber's
            set_curve(client_curve(config.server.curve_server_key, config.server.curve_client_key))
        except CurveKeyError as exc:
            print(f"parallm-train: {exc}", file=sys.stderr)
            return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    trainer = Trainer(config, router=config.server.router,
                      model=ModelConfig(path=config.model.path or "default", dtype=config.model.dtype), stop=stop)
    try:
        trainer.setup()
        return trainer.run()
    except (TrainerError, TaskError, ValueError) as exc:
        print(f"parallm-train: {exc}", file=sys.stderr)
        return 2
    finally:
        trainer.close()


if __name__ == "__main__":
    sys.exit(main())
