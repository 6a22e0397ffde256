"""ZeroMQ plumbing: socket addresses derived from the config, and typed sockets.

Every socket knows the message types it accepts: a frame that does not decode to one of them
is logged and dropped, never raised into a stage's loop. Stages never call raw send/recv.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from . import protocol
from .config import Config, TransportConfig
from .keys import Curve

log = logging.getLogger(__name__)

M = TypeVar("M")

# Fixed offsets from tcp_base_port, one per bound endpoint; tokenizers take the ports after the last.
_TCP_OFFSETS = {"engine": 0, "detok": 1, "router": 2, "supervisor": 3, "control": 4, "rollouts": 5,
                "adapters": 6, "training": 7, "tokenizer": 8}
MAX_FRAME_BYTES = 512 << 20
_max_frame_bytes = MAX_FRAME_BYTES
_curve: Curve | None = None
_authenticators: dict[int, tuple[ThreadAuthenticator, zmq.Context]] = {}
_auth_lock = threading.Lock()


def set_max_message_bytes(limit: int) -> None:
    """ZMQ_MAXMSGSIZE of every socket this process opens from now on (a stage sets it from
    `transport.max_message_mb` at start). ZeroMQ disconnects a peer that sends a larger message:
    the stage never sees it and goes on serving everyone else."""
    global _max_frame_bytes
    _max_frame_bytes = int(limit)


def set_curve(curve: Curve | None) -> None:
    """The CURVE keys every tcp:// socket of this process uses from now on, unless `open_socket`
    is given others (a stage sets them from `transport.curve_keys` at start)."""
    global _curve
    _curve = curve


def _authenticator(ctx: zmq.Context, allowed: frozenset[bytes]) -> None:
    """Start the ZAP handler of `ctx` (once per context): it admits only the `allowed` client keys.
    It runs on a blocking shadow of the context, so an asyncio context gets one too."""
    with _auth_lock:
        key = ctx.underlying
        if key in _authenticators:
            auth = _authenticators[key][0]
        else:
            shadow = zmq.Context.shadow(key)
            auth = ThreadAuthenticator(shadow, log=logging.getLogger("parallm.zap"))
            auth.start()
            _authenticators[key] = (auth, shadow)
        auth.allow_any = False
        auth.certs["*"] = {k: True for k in (*auth.certs.get("*", {}), *allowed)}


def stop_authenticators() -> None:
    """Stop every ZAP handler this process started (before terminating a context: its socket would
    keep `term()` waiting)."""
    with _auth_lock:
        for auth, shadow in _authenticators.values():
            auth.stop()
        _authenticators.clear()


def _apply_curve(ctx: zmq.Context, sock: zmq.Socket, curve: Curve, *, bind: bool) -> None:
    if bind:
        if curve.server_secret is None:
            raise ValueError("binding a tcp:// socket with CURVE needs the server's secret key")
        _authenticator(ctx, curve.allowed)
        sock.curve_secretkey = curve.server_secret
        sock.curve_publickey = curve.server_public
        sock.curve_server = True
    else:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret


@dataclass(frozen=True)
class Addresses:
    """Every endpoint of one deployment. Bound by the stage named in each comment."""

    engine: str          # engine PULL: Submit, Abort, Query, ... (tokenizers, ingress, raw clients, detok)
    detok: str           # detokenizer PULL: Track, StepOutputs, RequestError, QueryReply
    router: str          # detokenizer ROUTER: clients' DEALERs receive Outputs here
    supervisor: str      # supervisor PULL: Ready, Heartbeat, Fatal (ipc in the private run dir, even with tcp)
    control: str         # supervisor PUB: StageDown, StageUp, Drain, Shutdown
    rollouts: str        # detokenizer PUB: Rollout, topic = adapter name
    adapters: str        # engine SUB (bound): trainers' PUBs connect and publish AdapterPublish
    training: str        # ingress PULL: trainers push TrainingStatus
    tokenizers: tuple[str, ...] = field(default_factory=tuple)  # tokenizer PULLs
    policy: str = ""         # policy stage ROUTER: PolicyAct, Predict, ListPolicies, GetStats from DEALERs, answered there
    policy_weights: str = ""  # policy stage SUB (bound): trainers' PUBs connect and publish PolicyWeights

    def public(self) -> dict[str, str]:
        """What a raw client needs, as sent in Welcome."""
        return {"engine": self.engine, "router": self.router, "control": self.control,
                "rollouts": self.rollouts, "adapters": self.adapters, "training": self.training,
                "tokenizers": ",".join(self.tokenizers), "policy": self.policy,
                "policy_weights": self.policy_weights}


def addresses(config: Config) -> Addresses:
    t: TransportConfig = config.transport
    n_tok = config.tokenizer.replicas
    if t.kind == "ipc":
        if not t.run_dir:
            raise ValueError("transport.run_dir must be set for ipc (the supervisor creates one)")
        base = os.path.abspath(t.run_dir)

        def at(name: str) -> str:
            return f"ipc://{base}/{name}.sock"

        tokenizers = tuple(at(f"tokenizer-{i}") for i in range(n_tok))
    else:
        def at(name: str) -> str:
            return f"tcp://{t.tcp_host}:{t.tcp_base_port + _TCP_OFFSETS[name]}"

        first = t.tcp_base_port + _TCP_OFFSETS["tokenizer"]
        tokenizers = tuple(f"tcp://{t.tcp_host}:{first + i}" for i in range(n_tok))
        policy_port = first + n_tok  # the policy stage's two ports follow the tokenizers'
    # Heartbeats and READY/FATAL come only from the supervisor's own children on this machine:
    # their socket stays in the private run dir whenever there is one.
    supervisor = f"ipc://{os.path.abspath(t.run_dir)}/supervisor.sock" if t.run_dir else at("supervisor")
    return Addresses(engine=at("engine"), detok=at("detok"), router=at("router"),
                     supervisor=supervisor, control=at("control"), rollouts=at("rollouts"),
                     adapters=at("adapters"), training=at("training"), tokenizers=tokenizers,
                     policy=at("policy") if t.kind == "ipc" else f"tcp://{t.tcp_host}:{policy_port}",
                     policy_weights=at("policy-weights") if t.kind == "ipc" else f"tcp://{t.tcp_host}:{policy_port + 1}")


def _configure(sock: zmq.Socket, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, _max_frame_bytes)


def open_socket(ctx: zmq.Context, kind: int, address: str | list[str] | tuple[str, ...], *, bind: bool,
                hwm: int = 100_000, identity: bytes | None = None, curve: Curve | None = None) -> zmq.Socket:
    """A configured socket bound or connected to `address`. A tcp:// socket uses CURVE with `curve`
    (default: this process's, see `set_curve`) when there are keys; ipc:// ones never need it."""
    sock = ctx.socket(kind)
    _configure(sock, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    targets = [address] if isinstance(address, str) else list(address)
    keys = curve if curve is not None else _curve
    if keys is not None and any(t.startswith("tcp://") for t in targets):
        try:
            _apply_curve(ctx, sock, keys, bind=bind)
        except BaseException:
            sock.close(0)
            raise
    for target in targets:
        if bind:
            if target.startswith("ipc://"):
                path = target[len("ipc://"):]
                if os.path.exists(path):
                    os.unlink(path)
                sock.bind(target)
                os.chmod(path, 0o600)  # only this user may connect (the run dir is 0700 too)
            else:
                sock.bind(target)
        else:
            sock.connect(target)
    return sock


class Sender:
    """A PUSH or PUB socket that sends protocol messages."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def send(self, message: protocol.Message, *, topic: bytes | None = None, block: bool = True) -> bool:
        """Send; with block=False a full queue drops the message and returns False."""
        data = protocol.encode(message)
        flags = 0 if block else zmq.NOBLOCK
        try:
            if topic is None:
                self.sock.send(data, flags, copy=len(data) < 65536)
            else:
                self.sock.send_multipart([topic, data], flags, copy=len(data) < 65536)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.sock.close(0)


class Receiver(Generic[M]):
    """A PULL or SUB socket that yields messages of the accepted types; malformed frames are dropped,
    and `on_rejected` gets the error for one that names its sender (protocol.rejection)."""

    def __init__(self, sock: zmq.Socket, accepts: Any, *, name: str = "",
                 on_rejected: Callable[[protocol.RequestError], None] | None = None) -> None:
        self.sock = sock
        self.accepts = accepts
        self.decoder = protocol.Decoder(accepts)
        self.name = name or repr(accepts)
        self.on_rejected = on_rejected
        self.dropped = 0

    def _decode(self, frames: list[bytes]) -> M | None:
        data = frames[-1]
        try:
            return self.decoder.decode(data)
        except protocol.ProtocolError as exc:
            self.dropped += 1
            log.warning("dropped a malformed message on %s (%d bytes): %s", self.name, len(data), exc)
            if exc.reply is not None and self.on_rejected is not None:
                self.on_rejected(exc.reply)
            return None

    def recv(self, timeout_ms: int | None = None) -> M | None:
        """One message, or None when none arrived within timeout_ms (None = wait forever)."""
        while True:
            if timeout_ms is not None and not self.sock.poll(timeout_ms, zmq.POLLIN):
                return None
            message = self._decode(self.sock.recv_multipart(copy=True))
            if message is not None:
                return message

    def drain(self, limit: int = 10_000) -> Iterator[M]:
        """Every message already queued, without waiting."""
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = self._decode(frames)
            if message is not None:
                yield message

    def close(self) -> None:
        self.sock.close(0)


class Router:
    """The detokenizer's ROUTER: receives Hello from clients, sends each client its messages.

    With `mandatory` (ZMQ_ROUTER_MANDATORY) a send to an identity with no connection fails with
    EHOSTUNREACH instead of vanishing: `on_unreachable(identity)` is called so that the owner
    can abort what that client asked for. A full queue for a slow client (EAGAIN) only counts.
    """

    def __init__(self, sock: zmq.Socket, *, mandatory: bool = False,
                 on_unreachable: Callable[[bytes], None] | None = None, accepts: Any = protocol.RouterInbound,
                 on_rejected: Callable[[bytes, protocol.RequestError], None] | None = None,
                 name: str = "router") -> None:
        self.sock = sock
        self.accepts = accepts
        self.name = name
        self.decoder = protocol.Decoder(accepts)
        self.on_rejected = on_rejected  # (identity, the error for a rejected frame that names its qid)
        self.dropped = 0
        self.unroutable = 0
        self.unreachable = 0
        self.on_unreachable = on_unreachable
        if mandatory:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    def send(self, identity: bytes, message: protocol.Message) -> bool:
        try:
            self.sock.send_multipart([identity, protocol.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.unroutable += 1
            if exc.errno == zmq.EHOSTUNREACH:
                self.unreachable += 1
                if self.on_unreachable is not None:
                    self.on_unreachable(identity)
            return False
        return True

    def drain(self, limit: int = 10_000) -> Iterator[tuple[bytes, Any]]:
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            try:
                yield frames[0], self.decoder.decode(frames[-1])
            except protocol.ProtocolError as exc:
                self.dropped += 1
                log.warning("dropped a malformed client message from %r: %s", frames[0][:32], exc)
                error = exc.reply or protocol.rejection(frames[-1], str(exc), routed=True)
                if error is not None and self.on_rejected is not None:
                    self.on_rejected(frames[0], error)

    def close(self) -> None:
        self.sock.close(0)


class AsyncReceiver(Generic[M]):
    """asyncio twin of Receiver for zmq.asyncio sockets (ingress and the asyncio client)."""

    def __init__(self, sock: zmq.asyncio.Socket, accepts: Any, *, name: str = "") -> None:
        self.sock = sock
        self.accepts = accepts
        self.decoder = protocol.Decoder(accepts)
        self.name = name or repr(accepts)
        self.dropped = 0

    async def recv(self) -> M:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                return self.decoder.decode(frames[-1])
            except protocol.ProtocolError as exc:
                self.dropped += 1
                log.warning("dropped a malformed message on %s: %s", self.name, exc)

    def close(self) -> None:
        self.sock.close(0)


class AsyncSender:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock

    async def send(self, message: protocol.Message) -> None:
        await self.sock.send(protocol.encode(message))

    def send_nowait(self, message: protocol.Message) -> bool:
        try:
            self.sock.send(protocol.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.sock.close(0)
