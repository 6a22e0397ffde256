"""An engine replica on another machine, serving a parallm server (engine.remote_replicas).

    python -m parallm.launch.remote --replica I [the server's own options] \\
        --engine.remote-client-key keys/remote.key_secret

Run it with the options the server runs with (the same transport.tcp_host / tcp_base_port, whose
sockets it connects to; the same engine.replicas and engine.remote_replicas, whose entry
number I - engine.replicas is the address this machine's engine binds; the same model), plus
`--replica I`. It runs one engine stage here and starts it again when it exits (the server's
supervisor cannot), with the server's restart backoff.

Keys (transport.curve, on by default over tcp): the server and its remote engines share the server's
key pair (`transport.curve_server_key`, one NAME.key_secret on every machine): the engine here binds
its sockets with it, and the server's tokenizers and engine replica 0 connect to them with it. This
engine connects to the server's sockets with its own pair (`engine.remote_client_key`), whose public
key must be in the server's `transport.curve_clients`. The server's supervisor hears this engine's
READY and heartbeats and announces it up and down (launch/group.py RemoteReplicas).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from typing import Sequence

import msgspec

from parallm.config import Config, parse_args
from parallm.keys import CurveKeyError, load_allowed, load_pair

from .process import StageProcess, StageSpec

MAX_BACKOFF_S = 30.0


class RemoteError(ValueError):
    """The options do not describe a remote engine replica."""


def remote_config(config: Config, replica: int, run_dir: str) -> Config:
    """`config` as this machine's engine replica `replica` runs it: its CURVE keys (server pair for
    binding, its own pair for connecting, the server's public key admitted) and a local run dir."""
    engine, transport = config.engine, config.transport
    if not engine.replicas <= replica < engine.replicas + len(engine.remote_replicas):
        raise RemoteError(f"--replica {replica} is not a remote replica: the server has engine.replicas="
                          f"{engine.replicas} local ones and {len(engine.remote_replicas)} remote one(s) "
                          f"(engine.remote_replicas), numbered {engine.replicas}..")
    if engine.tensor_parallel > 1:
        raise RemoteError("a remote engine replica runs as one process (engine.tensor_parallel 1)")
    keys: list[str] = []
    if transport.curve:
        if not transport.curve_server_key or not engine.remote_client_key:
            raise RemoteError("over tcp with CURVE a remote engine needs the server's key pair "
                              "(transport.curve_server_key) and its own (engine.remote_client_key)")
        try:
            server_public, server_secret = load_pair(transport.curve_server_key)
            public, secret = load_pair(engine.remote_client_key)
            clients = load_allowed(transport.curve_clients) if transport.curve_clients else set()
        except CurveKeyError as exc:
            raise RemoteError(str(exc)) from None
        admitted = sorted({server_public, *clients})  # the server's stages connect with the server's pair
        keys = [k.decode() for k in (server_public, server_secret, public, secret, *admitted)]
    transport = msgspec.structs.replace(transport, curve_keys=keys, run_dir=run_dir)
    return msgspec.structs.replace(config, transport=transport)


def serve(config: Config, replica: int) -> int:
    """Run the engine stage, starting it again whenever it exits non-zero, until SIGTERM/SIGINT."""
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(1))
    parent_read, parent_write = os.pipe()
    stage = StageProcess(StageSpec("engine", replica=replica))
    backoff = 0.0
    try:
        while not stopping:
            started = time.monotonic()
            stage.start(config.encode(), parent_read, sys.stderr, config.log_format == "json")
            while stage.alive() and not stopping:
                time.sleep(0.2)
            if stopping:
                break
            code = stage.exit_code()
            if code == 0:  # the server shut down (its control channel said so)
                return 0
            backoff = config.supervisor.restart_backoff_s if time.monotonic() - started > 60 or not backoff \
                else min(MAX_BACKOFF_S, backoff * 2)
            print(f"parallm.launch.remote: engine replica {replica} exited with code {code}; starting it again "
                  f"in {backoff:.1f} s", file=sys.stderr, flush=True)
            time.sleep(backoff)
        return 0
    finally:
        stage.terminate(5.0)
        os.close(parent_write)
        os.close(parent_read)


def main(argv: Sequence[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--replica", type=int, required=True)
    known, rest = pre.parse_known_args(argv)
    config, _ = parse_args(rest, prog="python -m parallm.launch.remote --replica I",
                           description="an engine replica serving a parallm server on another machine")
    with tempfile.TemporaryDirectory(prefix="parallm-remote-") as run_dir:
        try:
            config = remote_config(config, known.replica, run_dir)
        except RemoteError as exc:
            print(f"parallm.launch.remote: {exc}", file=sys.stderr)
            return 2
        return serve(config, known.replica)


if __name__ == "__main__":
    sys.exit(main())
