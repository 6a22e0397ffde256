"""`parallm-launch`: start every stage of a parallm server and supervise them."""

from __future__ import annotations

import sys
from typing import Sequence

from parallm.config import parse_args
from parallm.logs import setup_logging

from .supervisor import Supervisor

DESCRIPTION = """Serve an MLX model over an OpenAI-compatible HTTP API and a raw ZeroMQ protocol.
Starts ingress, tokenizer(s), engine and detokenizer as separate processes and supervises them.
Every option can also be set in a TOML file (--config) or as a PARALLM_* environment variable;
the command line wins over the environment, which wins over the file."""


def main(argv: Sequence[str] | None = None) -> int:
    config, _ = parse_args(argv, prog="parallm-launch", description=DESCRIPTION)
    setup_logging(config.log_level, "supervisor", config.log_format)
    return Supervisor(config).run()


if __name__ == "__main__":
    sys.exit(main())
