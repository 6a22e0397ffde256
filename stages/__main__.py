"""Entry point of every stage process: `python -m parallm.stages <name> --config-file F [--replica N]`."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from parallm.config import Config
from parallm.runtime import die_with_parent, setup_logging

STAGES = ("ingress", "tokenizer", "engine", "detokenizer", "trainer")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m parallm.stages")
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--config-file", required=True)
    parser.add_argument("--parent-fd", type=int, default=None)
    args = parser.parse_args()
    die_with_parent(args.parent_fd)
    config = Config.decode(Path(args.config_file).read_bytes())
    setup_logging(config.log_level, args.stage)
    module = importlib.import_module(f"parallm.stages.{args.stage}")
    return module.main(config, args.replica)


if __name__ == "__main__":
    sys.exit(main())
