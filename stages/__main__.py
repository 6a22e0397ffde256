"""Entry point of every stage process: `python -m parallm.stages <name> --config-fd N [--replica N]`.

The supervisor writes the encoded configuration into the pipe `--config-fd` (it holds the API keys,
so it is never written to a file); `--config-file F` reads one from a file instead, for running a
stage by hand.

With PARALLM_PROFILE_STAGES=DIR set, the stage's main thread runs under cProfile in CPU time (the machine
may be shared), written to DIR/<stage>[-<replica>].prof when the stage exits and on SIGUSR2 (SIGUSR1 starts it over)
(perf/bench_single_stream.py --profile). Ingress has its own (PARALLM_PROFILE_INGRESS, perf/bench_ingress.py)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from parallm.config import Config
from parallm.keys import stage_curve
from parallm.logs import setup_logging
from parallm.runtime import die_with_parent
from parallm.threads import start_sampler
from parallm.transport import set_curve

STAGES = ("ingress", "tokenizer", "engine", "detokenizer", "trainer", "policy")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m parallm.stages")
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--replica", type=int, default=0)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config-fd", type=int)
    source.add_argument("--config-file")
    parser.add_argument("--parent-fd", type=int, default=None)
    args = parser.parse_args()
    die_with_parent(args.parent_fd)
    if args.config_fd is not None:
        with os.fdopen(args.config_fd, "rb") as pipe:
            config = Config.decode(pipe.read())
    else:
        config = Config.decode(Path(args.config_file).read_bytes())
    setup_logging(config.log_level, args.stage, config.log_format)
    start_sampler(args.stage if args.replica == 0 else f"{args.stage}-{args.replica}")  # PARALLM_THREAD_SAMPLES
    set_curve(stage_curve(config.transport.curve_keys))  # every tcp:// socket of this stage
    module = importlib.import_module(f"parallm.stages.{args.stage}")
    profile_dir = os.environ.get("PARALLM_PROFILE_STAGES", "")
    if not profile_dir:
        return module.main(config, args.replica)
    import cProfile
    import signal
    import time

    path = Path(profile_dir) / (f"{args.stage}.prof" if args.replica == 0 else f"{args.stage}-{args.replica}.prof")
    profilers = [cProfile.Profile(time.process_time)]

    def restart(*_: object) -> None:  # SIGUSR1: start over (a benchmark's measured part only)
        profilers[0].disable()
        profilers[0] = cProfile.Profile(time.process_time)
        profilers[0].enable()

    signal.signal(signal.SIGUSR1, restart)
    signal.signal(signal.SIGUSR2, lambda *_: profilers[0].dump_stats(path))
    profilers[0].enable()
    try:
        return module.main(config, args.replica)
    finally:
        profilers[0].disable()
        profilers[0].dump_stats(path)


if __name__ == "__main__":
    sys.exit(main())
