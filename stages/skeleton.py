"""The stage skeleton: every stage process's loop, written once. A stage keeps only its handlers.

What the skeleton does, so that a stage does not: it polls the stage's sockets and the supervisor's
control channel (waiting up to a heartbeat while idle), decodes every frame through the one codec (each
socket's `Receiver` checks it against the socket's union), hands each message to the handler its type
names in the socket's handler table, catches what a handler raises (`safely`: logged, counted, and
answered with a 400 RequestError at the address the message's type declares, `protocol.reply_address`),
dispatches control messages, sends heartbeats, and leaves the loop on Shutdown.

A new stage, whole (a pooling stage, say; `protocol.PoolingInbound` the union its socket accepts)::

    class PoolingStage(Stage):
        log = logging.getLogger("parallm.pooling")             # the stage's log; request ids go in each line

        def __init__(self, config: Config, runtime: StageRuntime) -> None:
            super().__init__(config, runtime)
            ctx, addrs, hwm = runtime.ctx, runtime.addrs, config.transport.hwm
            self.to_detok = Sender(open_socket(ctx, zmq.PUSH, addrs.detok, bind=False, hwm=hwm))
            inbox = Receiver(open_socket(ctx, zmq.PULL, addrs.pooling, bind=True, hwm=hwm),
                             protocol.PoolingInbound, name="pooling", on_rejected=self.answer)
            self.listen(inbox, {protocol.Pool: self.on_pool, protocol.GetStats: self.on_stats})
            self.control[protocol.StageDown] = self.on_stage_down  # only the control messages it cares about

        def answer(self, message: protocol.Message) -> None:   # replies and errors go to the detokenizer
            self.to_detok.send(message)

        def on_pool(self, message: protocol.Pool) -> None:
            self.answer(protocol.PoolReply(qid=message.qid, reply_to=message.reply_to, ...))

    def main(config: Config, replica: int = 0) -> int:
        runtime = StageRuntime(config, "pooling", replica)
        return PoolingStage(config, runtime).serve()

and a line in `stages/__main__.py` (the stage's name) and in the supervisor's topology to start it.

- `listen(source, handlers)`: one table per socket, message type -> handler. `listen` checks that the
  table covers every type of the socket's union, so a type added to a union without a handler fails
  when the stage starts, not when the message arrives. A `transport.Router` source's handlers take
  `(identity, message)`; every other's take the message.
- `watch(sock, on_ready)`: a socket that is not a message source (an XPUB's subscription notices).
- `control`: a handler table for the supervisor's control messages; Drain and Shutdown set the runtime's
  flags whatever it holds.
- `answer(message)`: where the stage sends replies, and `safely`'s errors (the detokenizer, for most).
- `work() -> bool`: what the stage does between messages (the engine's step): True when it worked and
  has more to do (the next poll does not wait), False when idle. `idle_wait_ms()` bounds an idle poll;
  `tick()` runs before each poll; `in_flight()` is what the heartbeat reports; `stop(code)` leaves the
  loop with an exit code. A stage with no work between messages overrides none of them.
- `handled`, `failed`: messages handed to a handler, and those whose handler raised.
- `loop_time` / `loop_stats()`: where working iterations go: `inbox_s` (polling and handling, not an idle
  poll's wait), what `work()` adds under its own keys, `beat_s`.

A new message type for an existing stage touches its struct and its receiver's union (one module of
parallm/protocol/), one entry in the stage's handler table and the handler (the stage's module), and its
line in docs/protocol.md.
"""

from __future__ import annotations

import logging
import os
import time
import typing
import weakref
from collections import Counter
from typing import Any, Callable, ClassVar, Mapping

import zmq

from parallm import protocol
from parallm.config import Config
from parallm.logs import request_extra
from parallm.runtime import StageRuntime
from parallm.transport import Receiver, Router

Handler = Callable[..., None]
"""A message's handler: `handler(message)`, or `handler(identity, message)` for a ROUTER's messages."""


class Waker:
    """Wakes a stage's poll from another thread (a worker thread's finished future: `future.add_done_callback(
    stage.waker.wake)`): a pipe its poller watches. Without it the loop saw a worker's result only at its next
    timed poll (the tokenizer's 5 ms while a large request was tokenized: every image request, whose data URL
    counts as text; issue 37)."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)
        weakref.finalize(self, _close_fds, self.fd, self._write)

    def wake(self, *_: object) -> None:
        try:
            os.write(self._write, b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed (the stage is gone)
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Stage:
    """A stage process's loop; a subclass adds its sockets with their handler tables (see the module)."""

    log: ClassVar[logging.Logger] = logging.getLogger("parallm.stage")

    def __init__(self, config: Config, runtime: StageRuntime) -> None:
        self.config = config
        self.rt = runtime
        self.beat_ms = max(1, int(config.supervisor.heartbeat_s * 1000))
        self.control: dict[type, Handler] = {}
        self.handled = 0
        self.failed = 0
        self.loop_time: Counter[str] = Counter()  # seconds per loop phase, over working iterations
        self.loop_steps = 0
        self.exit_code: int | None = None
        self._poller = zmq.Poller()
        self._on_ready: dict[zmq.Socket | int, Callable[[], None]] = {}  # a socket, or a file descriptor
        self._tables: list[Mapping[type, Handler]] = []
        self._poller.register(runtime.control.sock, zmq.POLLIN)  # read after the stage's own sockets
        self.waker = Waker()  # worker threads wake the poll (the poller reports a descriptor as its number)
        self._poller.register(self.waker.fd, zmq.POLLIN)
        self._on_ready[self.waker.fd] = self.waker.drain

    # ------------------------------------------------------------------ what a stage declares
    def listen(self, source: Receiver[Any] | Router, handlers: Mapping[type, Handler], *, limit: int = 10_000) -> None:
        """Hand every message that arrives on `source` (up to `limit` per poll) to its type's handler."""
        accepts = typing.get_args(source.accepts) or (source.accepts,)
        missing = [kind.__name__ for kind in accepts if kind not in handlers]
        if missing:
            raise TypeError(f"{type(self).__name__} has no handler for {', '.join(missing)} on {source.name}")
        self._tables.append(handlers)
        if isinstance(source, Router):
            self.watch(source.sock, lambda: self._dispatch_routed(source, handlers, limit))
        else:
            self.watch(source.sock, lambda: self._dispatch(source, handlers, limit))

    def watch(self, sock: zmq.Socket, on_ready: Callable[[], None]) -> None:
        """Call `on_ready` when `sock` has something to read (the stage reads it)."""
        self._poller.register(sock, zmq.POLLIN)
        self._on_ready[sock] = on_ready

    def answer(self, message: protocol.Message) -> None:
        """Send a reply or an error toward its client; a stage that answers overrides this (one that
        does not only logs what it could not send)."""
        self.log.warning("%s has nowhere to send a %s", type(self).__name__, type(message).__name__)

    def tick(self) -> None:
        """Before each poll."""

    def work(self) -> bool:
        """After each poll's messages: the stage's own work. True: it worked and has more (no wait)."""
        return False

    def idle_wait_ms(self) -> int:
        """How long a poll may wait for a message while the stage has no work."""
        return self.beat_ms

    def in_flight(self) -> int:
        """What the stage holds (the heartbeat reports it; the supervisor drains until it is 0)."""
        return 0

    def stop(self, code: int) -> None:
        """Leave the loop after this iteration; `run` returns `code`."""
        self.exit_code = code

    # ------------------------------------------------------------------ the machinery
    def handle(self, message: Any) -> None:
        """Hand one message to its handler in the first table that names its type (the stage's inbox:
        tests and in-process callers drive a stage with this)."""
        for table in self._tables:
            handler = table.get(type(message))
            if handler is not None:
                self.handled += 1
                handler(message)
                return
        raise TypeError(f"{type(self).__name__} has no handler for a {type(message).__name__}")

    def safely(self, handler: Handler, *args: Any) -> None:
        """Run `handler(*args)` (the message is the last argument); if it raises, the message is logged,
        counted and dropped, and answered with a 400 at its reply address when its type names one. The
        error names the exception's type only: its text may hold server paths and errno strings, which
        stay in the log."""
        try:
            handler(*args)
        except Exception as exc:  # noqa: BLE001 - one bad message must not take the stage down
            self.failed += 1
            message = args[-1]
            address = protocol.reply_address(message)
            rid, reply_to = address or ("", b"")
            self.log.exception("could not handle a %s", type(message).__name__,
                               extra=request_extra(rid) if rid else None)
            if address is not None:
                self.answer(protocol.RequestError(rid=rid, reply_to=reply_to, status=400, message=(
                    f"the {self.rt.stage} could not handle this request ({type(exc).__name__}); "
                    "the server logged why")))

    def _dispatch(self, source: Receiver[Any], handlers: Mapping[type, Handler], limit: int) -> None:
        for message in source.drain(limit):
            self.handled += 1
            self.safely(handlers[type(message)], message)

    def _dispatch_routed(self, source: Router, handlers: Mapping[type, Handler], limit: int) -> None:
        for identity, message in source.drain(limit):
            self.handled += 1
            self.safely(handlers[type(message)], identity, message)

    def _read_control(self) -> None:
        for message in self.rt.poll_control():  # Drain and Shutdown set the runtime's flags
            handler = self.control.get(type(message))
            if handler is not None:
                self.safely(handler, message)

    def loop_stats(self) -> protocol.LoopStats:
        return protocol.LoopStats(steps=self.loop_steps, ms_mean={
            k[:-2]: 1000 * v / max(1, self.loop_steps) for k, v in self.loop_time.items()})

    def run(self) -> int:
        """The loop: poll (without waiting while there is work; up to `idle_wait_ms` while idle), hand
        out what arrived, `work()`, heartbeat; until Shutdown or `stop`. Returns the exit code."""
        clock, spent = time.perf_counter, self.loop_time
        wait = 0
        while not self.rt.shutting_down and self.exit_code is None:
            t0 = clock()
            self.tick()
            ready = dict(self._poller.poll(wait))
            if wait:
                t0 = clock()  # the wait of an idle poll is not the loop's work
            for sock, on_ready in self._on_ready.items():
                if sock in ready:
                    on_ready()
            if self.rt.control.sock in ready:
                self._read_control()
            t1 = clock()
            busy = self.work()
            if self.exit_code is not None:
                break
            t2 = clock()
            self.rt.heartbeat(self.in_flight)
            wait = 0 if busy else self.idle_wait_ms()
            if busy:
                self.loop_steps += 1
                spent["inbox_s"] += t1 - t0
                spent["beat_s"] += clock() - t2
        return self.exit_code or 0

    def serve(self, info: dict[str, Any] | None = None) -> int:
        """A stage process's life after start-up: tell the supervisor it is ready (with `info`), run the
        loop until Shutdown, and close the runtime's sockets whatever happens. Returns the exit code."""
        self.rt.ready(info)
        try:
            return self.run()
        finally:
            self.rt.close()


def text_tokenizer(config: Config, runtime: StageRuntime) -> tuple[Any, dict[str, Any]] | None:
    """The model's text tokenizer and its limits (parallm.text.loading), or None once the supervisor was
    told why it could not be loaded (the stage then exits with 2)."""
    from parallm.text.loading import load_text_tokenizer

    try:
        return load_text_tokenizer(config.model)
    except (OSError, ValueError) as exc:
        runtime.fatal(f"cannot load the tokenizer of {config.model.path!r}: {exc}")
        return None
