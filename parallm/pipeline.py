"""One asyncio connection to a running server's pipeline: what the raw clients and ingress share.

It needs one address, the detokenizer's ROUTER. It says Hello on a DEALER until the router answers
Welcome (which names the engine, tokenizer and control addresses), then pushes token-id requests and
control requests to the engine, text requests and tokenizer queries to the tokenizers, and asks the
detokenizer for its stats through the router. One reader (a callback on the DEALER's descriptor)
dispatches what comes back: Outputs items to each request's stream by rid, an error to its stream or
to the control request whose qid it names, typed replies to the waiting control request by qid. A
task watches the control channel.

A stage that dies (StageDown on the control channel) takes what it could hold with it, and that ends
at once with a retryable error: the engine or the detokenizer, every request and control request in
flight; a tokenizer, the requests sent through a tokenizer that have heard nothing back yet (token-id
requests never pass one) and the tokenizer queries. Malformed frames are dropped and counted. If the
reader or the control watcher fails, everything in flight fails with it (loudly) and it restarts;
after MAX_RESTARTS failures the connection refuses new work instead of going quiet. A restarted
detokenizer stays down for this connection after its StageUp until Hello, repeated, gets its Welcome:
only then can its mandatory ROUTER route to this DEALER (before, a send reads as a client gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Iterable, Literal

import zmq
import zmq.asyncio

from . import protocol
from .streams import ClientError, RequestStream, StageFailure, error_of
from .keys import Curve
from .transport import open_socket

log = logging.getLogger(__name__)

Target = Literal["engine", "tokenizer", "detokenizer"]
TARGETS = ("engine", "tokenizer", "detokenizer")
HELLO_INTERVAL_S = 0.5
REHELLO_INTERVAL_S = 0.05  # after a detokenizer restart: how often Hello repeats until the new router answers
MAX_RESTARTS = 5
READ_BATCH = 256          # messages the reader dispatches before letting other callbacks run


def _failure(rid: str, status: int, code: str, message: str) -> protocol.RequestError:
    return protocol.RequestError(rid=rid, status=status, code=code, message=message, retryable=True)


Listener = Callable[[Any], None]


class Pipeline:
    """The connection. Every method runs on the event loop that called `connect()`."""

    def __init__(self, router: str, *, identity: bytes, ctx: zmq.Context | None = None, hwm: int = 100_000,
                 hello_timeout_s: float = 30.0, curve: Curve | None = None) -> None:
        self.router = router
        self.curve = curve  # CURVE keys for tcp:// (None: this process's, parallm.transport.set_curve)
        self.identity = identity
        self.hello_timeout_s = hello_timeout_s
        self.hwm = hwm
        self.welcome: protocol.Welcome | None = None
        self.stages_down: set[str] = set()   # "stage-replica" of every stage announced down and not up again
        self.last_batch_size = 0              # the engine's decode batch size in the latest Outputs
        self.dropped_frames = 0               # frames that were no message this connection accepts
        self.failed_messages = 0              # messages whose handling raised (logged, dropped)
        self.restarts = 0                     # reader or control-watcher failures
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[str, tuple[str, asyncio.Future]] = {}
        self._listeners: list[Listener] = []
        self._tasks: dict[str, asyncio.Task] = {}
        self._sockets: list[zmq.Socket] = []
        self._blocking: dict[str, zmq.asyncio.Socket] = {}
        self._decoder = protocol.Decoder(protocol.ClientInbound)
        self._control_decoder = protocol.Decoder(protocol.ControlMessage)
        self._closing = False
        self._broken = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dealer: zmq.Socket | None = None
        self._rehello: dict[str, protocol.StageUp] = {}  # restarted detokenizers announced up, not yet answering Hello
        self._reading = False
        self._welcomed: asyncio.Future | None = None
        self._push: dict[str, zmq.Socket] = {}
        self._engine_replicas = 1

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> protocol.Welcome:
        """Hello until Welcome (ClientError 503 after `hello_timeout_s`), then the other sockets."""
        self._loop = asyncio.get_running_loop()
        self._dealer = self._open(zmq.DEALER, self.router, identity=self.identity)
        self._welcomed = self._loop.create_future()
        self._read()
        hello = protocol.encode(protocol.Hello(client=self.identity.decode(errors="replace")))
        deadline = time.monotonic() + self.hello_timeout_s
        while not self._welcomed.done():
            left = deadline - time.monotonic()
            if left <= 0:
                await self.close()
                raise StageFailure(f"no Welcome from the router at {self.router} within {self.hello_timeout_s:g} s "
                                   "(is parallm-launch running? over tcp:// it admits only CURVE keys it allows)", status=503, code="no_welcome", retryable=True)
            self._send_dealer(hello)
            await asyncio.wait([self._welcomed], timeout=min(HELLO_INTERVAL_S, left))
        self.welcome = self._welcomed.result()
        addrs = self.welcome.addresses
        self._engine_replicas = int(addrs.get("engine_replicas") or 1)
        self._push = {"engine": self._open(zmq.PUSH, addrs["engine"]),
                      "tokenizer": self._open(zmq.PUSH, addrs["tokenizers"].split(","))}
        control = self._open(zmq.SUB, addrs["control"])
        control.setsockopt(zmq.SUBSCRIBE, b"")
        self._control = zmq.asyncio.Socket.from_socket(control)
        self._start_watch()
        return self.welcome

    def _open(self, kind: int, address: str | list[str], identity: bytes | None = None) -> zmq.Socket:
        sock = open_socket(self._ctx, kind, address, bind=False, hwm=self.hwm, identity=identity, curve=self.curve)
        self._sockets.append(sock)
        return sock

    async def close(self) -> None:
        """Cancel the tasks and close the sockets. What is in flight ends with ClientError 499 here;
        the server aborts the requests of a client whose DEALER went away."""
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all(499, "client_closed", "the connection was closed")
        for sock in self._sockets:
            sock.close(0)
        if self._own_ctx:
            self._ctx.term()

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(message)` for every control message (StageDown, StageUp, Drain, Shutdown),
        after the connection has failed what a dead stage held."""
        self._listeners.append(listener)

    @property
    def in_flight(self) -> int:
        """Requests whose outputs are still coming."""
        return len(self._streams)

    # ------------------------------------------------------------------ requests
    async def open(self, message: protocol.Submit | protocol.TextSubmit, *, timeout: float | None = None,
                   block: bool = True) -> RequestStream:
        """Send a request and return its stream: a Submit goes to the engine, a TextSubmit through a
        tokenizer. `timeout`: the longest wait for the next output (None: no limit); `block=False`: a
        full queue raises ClientError 503 `overloaded` instead of waiting."""
        self._check_open()
        if message.spec.n < 1:
            raise ValueError(f"n must be at least 1, not {message.spec.n}")
        if message.rid in self._streams:
            raise ValueError(f"request id {message.rid!r} is already in flight on this connection")
        via_tokenizer = type(message) is protocol.TextSubmit
        target = "tokenizer" if via_tokenizer else "engine"
        message.reply_to = self.identity
        stream = RequestStream(message.rid, message.spec.n, via_tokenizer, timeout, loop=self._loop,
                               forget=self._forget, abort=self.abort)
        self._streams[message.rid] = stream
        try:
            await self._send(target, protocol.encode(message), block)
        except BaseException:
            stream.end()
            raise
        stream.start_timer()
        return stream

    def abort(self, rids: Iterable[str] = (), *, all: bool = False, sequences: Iterable[tuple[str, int]] = (),
              reason: protocol.FinishReason = "abort") -> bool:
        """Ask the engine to end requests (every sample), single samples, or all; never waits (False
        when the engine's queue is full or the connection is closed)."""
        if self._closing or "engine" not in self._push:
            return False
        message = protocol.Abort(rids=[str(rid) for rid in rids], sequences=[(str(r), i) for r, i in sequences],
                                 all=all, reason=reason)
        return self._try_send("engine", protocol.encode(message))

    async def call(self, target: Target, message: Any, *, timeout: float) -> Any:
        """Send a control request (its qid and reply_to are filled in here) and return its typed reply;
        a RequestError answer raises ClientError, no answer within `timeout` StageFailure 503 `timeout`."""
        self._check_open()
        if target not in TARGETS:
            raise ValueError(f"no stage {target!r} to ask; one of {', '.join(TARGETS)}")
        message.qid, message.reply_to = uuid.uuid4().hex, self.identity
        future = self._loop.create_future()
        self._calls[message.qid] = (target, future)
        try:
            data = protocol.encode(message)
            if target == "detokenizer":
                if not self._send_dealer(data):
                    raise StageFailure("the router's queue is full; retry shortly", status=503, code="overloaded",
                                       retryable=True)
            else:
                await self._send(target, data, True)
            reply = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise StageFailure(f"the {target} did not answer {type(message).__name__} within {timeout:g} s",
                               status=503, code="timeout", retryable=True) from None
        finally:
            self._calls.pop(message.qid, None)
        if type(reply) is protocol.RequestError:
            raise error_of(reply)
        return reply

    # ------------------------------------------------------------------ sending
    def _try_send(self, target: str, data: bytes) -> bool:
        try:
            self._push[target].send(data, zmq.NOBLOCK, copy=len(data) < 65536)
        except zmq.Again:
            return False
        return True

    async def _send(self, target: str, data: bytes, block: bool) -> None:
        if self._try_send(target, data):
            return
        if not block:
            raise StageFailure(f"the {target} queue is full; retry shortly", status=503, code="overloaded",
                               retryable=True)
        sock = self._blocking.get(target)
        if sock is None:
            sock = self._blocking[target] = zmq.asyncio.Socket.from_socket(self._push[target])
        await sock.send(data, copy=len(data) < 65536)

    def _send_dealer(self, data: bytes) -> bool:
        try:
            self._dealer.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:  # a send can take the DEALER's read edge: look for messages it left waiting
            self._loop.call_soon(self._on_readable)
        return True

    def _check_open(self) -> None:
        if self._broken:
            raise StageFailure(self._broken, status=503, code="connection_broken", retryable=False)
        if self._closing or self._loop is None:
            raise ClientError("the connection is not open", status=499, code="client_closed")

    # ------------------------------------------------------------------ inbound
    def _decode(self, decoder: protocol.Decoder, frame: bytes) -> Any:
        try:
            return decoder.decode(frame)
        except protocol.ProtocolError as exc:
            self.dropped_frames += 1
            log.warning("dropped a malformed message (%d bytes) for %r: %s", len(frame), self.identity, exc)
            return None

    def _read(self) -> None:
        """Start the reader: a callback on the DEALER's file descriptor that dispatches every waiting
        message. (A callback rather than a task awaiting zmq.asyncio's recv: that costs a future and
        two epoll_ctl calls per wait, which measured ~40 us of every round trip.)"""
        self._reading = True
        self._loop.add_reader(self._dealer.getsockopt(zmq.FD), self._on_readable)
        self._on_readable()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._dealer.getsockopt(zmq.FD))

    def _on_readable(self) -> None:
        if not self._reading:
            return
        recv = self._dealer.recv_multipart
        try:
            for _ in range(READ_BATCH):
                try:
                    frames = recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                message = self._decode(self._decoder, frames[-1])
                if message is not None:
                    self._guarded(self._dispatch, message)
        except Exception as exc:  # noqa: BLE001 - the socket itself failed: fail loudly, restart
            self._stop_reading()
            self._failed("reader", exc, self._read)
            return
        self._loop.call_soon(self._on_readable)  # more may be waiting; let other callbacks run first

    async def _watch(self) -> None:
        while True:
            message = self._decode(self._control_decoder, (await self._control.recv_multipart())[-1])
            if message is not None:
                self._guarded(self._on_control, message)

    def _guarded(self, handler: Callable[[Any], None], message: Any) -> None:
        try:
            handler(message)
        except Exception:  # noqa: BLE001 - one bad message must not stop delivery to everyone else
            self.failed_messages += 1
            log.exception("dropped a %s this connection could not handle", type(message).__name__)

    def _dispatch(self, message: Any) -> None:
        kind = type(message)
        if kind is protocol.Outputs:
            self.last_batch_size = message.batch_size
            streams = self._streams
            stale: list[str] = []
            for item in message.items:
                stream = streams.get(item.rid)
                if stream is not None:
                    stream.deliver(item)
                elif item.finish_reason is None:
                    stale.append(item.rid)
            if stale:  # outputs of a request nobody reads any more
                self.abort(set(stale))
        elif kind is protocol.RequestError:
            call = self._calls.pop(message.rid, None)
            if call is not None:
                if not call[1].done():
                    call[1].set_result(message)
                return
            stream = self._streams.get(message.rid)
            if stream is not None:
                stream.fail(message)
        elif isinstance(message, protocol.REPLIES):
            call = self._calls.pop(message.qid, None)
            if call is not None and not call[1].done():
                call[1].set_result(message)
        elif kind is protocol.Welcome:  # the answer to Hello (or a late one to a repeated Hello)
            if not self._welcomed.done():
                self._welcomed.set_result(message)
            elif self._rehello:  # a restarted detokenizer's router can route to this DEALER now
                ups = list(self._rehello.values())
                self._rehello.clear()
                for up in ups:
                    self.stages_down.discard(f"{up.stage}-{up.replica}")
                    for listener in self._listeners:
                        self._guarded(listener, up)

    def _on_control(self, message: Any) -> None:
        if type(message) is protocol.StageDown:
            self.stages_down.add(f"{message.stage}-{message.replica}")
            self._fail_stage(message.stage, message.replica)
        elif type(message) is protocol.StageUp:
            if message.stage == "detokenizer":
                self._await_router(message)
                return
            self.stages_down.discard(f"{message.stage}-{message.replica}")
        for listener in self._listeners:
            self._guarded(listener, message)

    def _await_router(self, up: protocol.StageUp) -> None:
        """A restarted detokenizer is up only for this connection once its ROUTER can route to this
        DEALER: until the DEALER has reconnected, the router's mandatory send of a request's first
        output fails (EHOSTUNREACH), which reads as a client gone and aborts the request unanswered.
        So the stage stays down here, and Hello repeats until the new router answers Welcome."""
        self._rehello[f"{up.stage}-{up.replica}"] = up
        if "rehello" in self._tasks and not self._tasks["rehello"].done():
            return
        self._tasks["rehello"] = self._loop.create_task(self._say_hello_again())

    async def _say_hello_again(self) -> None:
        hello = protocol.encode(protocol.Hello(client=self.identity.decode(errors="replace")))
        while self._rehello and not self._closing:
            self._send_dealer(hello)
            await asyncio.sleep(REHELLO_INTERVAL_S)

    def _fail_stage(self, stage: str, replica: int = 0) -> None:
        """Fail what a dead stage could hold (see the module docstring)."""
        if stage == "engine" and self._engine_replicas > 1:
            # one engine replica of several: the tokenizers and the detokenizer fail what was sent to it
            # or held by it (parallm/routing.py); here what went straight to replica 0, and its control calls
            if replica != 0:
                return
            lost = [s for s in self._streams.values() if not s.via_tokenizer]
        elif stage in ("engine", "detokenizer"):
            lost = list(self._streams.values())
        elif stage == "tokenizer":
            lost = [s for s in self._streams.values() if s.via_tokenizer and not s.heard]
        else:
            return
        text = f"the {stage} stage restarted while this request was in flight; retry it"
        for stream in lost:
            stream.fail(_failure(stream.rid, 503, "stage_restarted", text))
        if lost and stage != "engine":  # the engine may hold them: free their rows
            self.abort([s.rid for s in lost])
        calls = [qid for qid, (target, _) in self._calls.items() if stage == "detokenizer" or target == stage]
        for qid in calls:
            _, future = self._calls.pop(qid)
            if not future.done():
                future.set_result(_failure(qid, 503, "stage_restarted", text))
        if lost or calls:
            log.warning("%s died: failed %d request(s) and %d control request(s) in flight", stage, len(lost),
                        len(calls))

    def _forget(self, stream: RequestStream) -> None:
        """A stream ended (its end() calls this): nothing more is delivered to its rid."""
        if self._streams.get(stream.rid) is stream:
            del self._streams[stream.rid]

    def _fail_all(self, status: int, code: str, text: str) -> None:
        for stream in list(self._streams.values()):
            stream.fail(protocol.RequestError(rid=stream.rid, status=status, code=code, message=text,
                                              retryable=status >= 500))
        for qid, (_, future) in list(self._calls.items()):
            if not future.done():
                future.set_result(protocol.RequestError(rid=qid, status=status, code=code, message=text,
                                                        retryable=status >= 500))
        self._calls.clear()

    # ------------------------------------------------------------------ supervision
    def _start_watch(self) -> None:
        task = self._loop.create_task(self._watch(), name="pipeline-control")
        task.add_done_callback(self._watch_ended)
        self._tasks["control"] = task

    def _watch_ended(self, task: asyncio.Task) -> None:
        if not self._closing and not task.cancelled():
            self._failed("control watcher", task.exception(), self._start_watch)

    def _failed(self, name: str, exc: BaseException | None, restart: Callable[[], None]) -> None:
        """The reader or the control watcher stopped: fail everything in flight, then restart it
        (after MAX_RESTARTS failures, refuse new work instead)."""
        self.restarts += 1
        log.error("the client connection's %s stopped (%r): failing everything in flight", name, exc)
        self._fail_all(503, "connection_error", f"the client connection's {name} failed ({exc!r}); retry")
        if self.restarts > MAX_RESTARTS:
            self._broken = f"the client connection failed {self.restarts} times (last: {exc!r}); open a new one"
            return
        self._loop.call_later(0.1 * self.restarts, lambda: None if self._closing else restart())
