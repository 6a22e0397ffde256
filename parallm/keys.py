"""CurveZMQ keys: who may connect to a server's tcp:// sockets.

Over tcp:// every socket is a CURVE server (encrypted, authenticated): a peer connects only with
the server's public key and a client key pair whose public half is on the allow-list. Key files
are pyzmq's certificates (`zmq.auth.create_certificates`, or `python -m parallm.keys new DIR NAME`):
`NAME.key` holds the public key, `NAME.key_secret` the pair.

The supervisor loads the server pair (`transport.curve_server_key`) or makes a fresh one, makes a
pair for its own stages, and hands both to the stages with the allow-list (`transport.curve_clients`,
a directory of public key files) through the config pipe, never a file. A fresh server pair's
public key is written to `<run dir>/server.key` for local clients.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

SERVER_PUBLIC_FILE = "server.key"


class CurveKeyError(ValueError):
    """A key file is missing or is not a CURVE certificate."""


@dataclass(frozen=True)
class Curve:
    """The keys one process uses on tcp:// sockets.

    Connecting, it is a CURVE client with (`public`, `secret`) to the server `server_public`.
    Binding (a stage or the supervisor), it is the CURVE server (`server_public`, `server_secret`)
    and admits only the clients in `allowed`."""

    server_public: bytes
    public: bytes
    secret: bytes
    server_secret: bytes | None = None
    allowed: frozenset[bytes] = field(default_factory=frozenset)


def _load(path: str | os.PathLike, *, secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if secret and p.suffix != ".key_secret" and Path(f"{p}_secret").is_file():
        p = Path(f"{p}_secret")
    try:
        public, private = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE key file {str(p)!r}: {exc}") from None
    if secret and not private:
        raise CurveKeyError(f"CURVE key file {str(p)!r} has no secret key (give the NAME.key_secret file)")
    return public, private


def load_public(path: str | os.PathLike) -> bytes:
    """The public key of a certificate file (NAME.key or NAME.key_secret)."""
    return _load(path, secret=False)[0]


def load_pair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file (NAME.key is taken to mean its _secret twin)."""
    public, secret = _load(path, secret=True)
    assert secret is not None
    return public, secret


def load_allowed(directory: str | os.PathLike) -> set[bytes]:
    """Public keys of every *.key file in `directory` (the allow-list of raw clients and trainers)."""
    d = Path(directory)
    if not d.is_dir():
        raise CurveKeyError(f"transport.curve_clients {str(d)!r} is not a directory of public key files")
    return {load_public(p) for p in sorted(d.glob("*.key"))}


def client_curve(server_key: str | os.PathLike, client_key: str | os.PathLike) -> Curve:
    """A client's keys: the server's public key file and its own NAME.key_secret file."""
    public, secret = load_pair(client_key)
    return Curve(server_public=load_public(server_key), public=public, secret=secret)


def supervisor_keys(curve_server_key: str, curve_clients: str, run_dir: str) -> list[str]:
    """What the supervisor hands its stages (`transport.curve_keys`, z85 text): server public,
    server secret, stage public, stage secret, then every allowed client public key."""
    if curve_server_key:
        server_public, server_secret = load_pair(curve_server_key)
    else:
        server_public, server_secret = zmq.curve_keypair()
        path = Path(run_dir) / SERVER_PUBLIC_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("#   parallm server public key (CURVE)\ncurve\n"
                    f'    public-key = "{server_public.decode()}"\n')
    stage_public, stage_secret = zmq.curve_keypair()
    allowed = load_allowed(curve_clients) if curve_clients else set()
    return [k.decode() for k in (server_public, server_secret, stage_public, stage_secret, *sorted(allowed))]


def stage_curve(curve_keys: list[str] | tuple[str, ...]) -> Curve | None:
    """A stage's keys from `transport.curve_keys` (None when CURVE is off)."""
    if not curve_keys:
        return None
    if len(curve_keys) < 4:
        raise CurveKeyError("transport.curve_keys is set by the supervisor; leave it empty")
    server_public, server_secret, public, secret, *clients = (k.encode() for k in curve_keys)
    return Curve(server_public=server_public, server_secret=server_secret, public=public, secret=secret,
                 allowed=frozenset([public, *clients]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallm.keys",
                                     description="Make a CURVE key pair: DIR/NAME.key (public) and DIR/NAME.key_secret")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new")
    new.add_argument("dir")
    new.add_argument("name")
    args = parser.parse_args(argv)
    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(args.dir, args.name)
    os.chmod(secret_file, 0o600)
    print(public_file)
    print(secret_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
