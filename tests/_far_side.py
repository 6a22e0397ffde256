"""A scripted far side for the pipeline connection's tests: real ZeroMQ sockets in this process
standing in for the detokenizer's router, the engine, one tokenizer and the supervisor's control
channel, laid out as `transport.addresses` lays out a run dir."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import zmq

from parallm import protocol

Script = Callable[[str, Any], list]


def finished_outputs(message: Any, tokens: int = 1) -> list:
    """What an engine that finishes at once sends back for a request: one output per sample."""
    return [protocol.Outputs(items=[protocol.Output(rid=message.rid, index=i, token_ids=protocol.pack_ids([7] * tokens),
                                                     finish_reason="length") for i in range(message.spec.n)],
                             batch_size=message.spec.n)]


def answer(stage: str, message: Any) -> list:
    """The default script: requests finish at once, control requests get their typed reply."""
    if isinstance(message, (protocol.Submit, protocol.TextSubmit)):
        return finished_outputs(message)
    if isinstance(message, protocol.GetStats):
        stats = {"engine": protocol.EngineStats(running=3), "tokenizer": protocol.TokenizerStats(handled=5),
                 "detokenizer": protocol.DetokenizerStats(outputs=9)}[stage]
        return [protocol.StatsReply(qid=message.qid, stats=stats)]
    if isinstance(message, protocol.Score):
        ids = protocol.unpack_ids(message.ids)[message.start:]
        return [protocol.ScoreReply(qid=message.qid, logprobs=protocol.pack_floats([-0.5] * len(ids)))]
    if isinstance(message, (protocol.Pause, protocol.Resume)):
        return [protocol.PauseState(qid=message.qid, paused=isinstance(message, protocol.Pause))]
    if isinstance(message, protocol.ListAdapters):
        return [protocol.AdapterList(qid=message.qid, policy={"pol": 4})]
    if isinstance(message, protocol.AdapterPublish):
        return [protocol.AdapterLoaded(qid=message.qid, name=message.name, version=message.version or 1)]
    if isinstance(message, protocol.AdapterUnload):
        return [protocol.RequestError(rid=message.qid, status=404, code="adapter_not_found", message="no such")]
    if isinstance(message, protocol.Tokenize):
        return [protocol.TokenizeReply(qid=message.qid, ids=protocol.pack_ids([len(message.prompt or "")]))]
    if isinstance(message, protocol.Detokenize):
        return [protocol.DetokenizeReply(qid=message.qid, text=str(protocol.unpack_ids(message.ids)))]
    return []


class FarSide:
    """The server's sockets, bound in `run_dir`, served by a thread: Hello gets Welcome, every message
    pulled by the engine or tokenizer (or asked of the router) is recorded and answered by `script`."""

    def __init__(self, run_dir, script: Script = answer) -> None:
        self.script = script
        self.ctx = zmq.Context()
        at = {name: f"ipc://{run_dir}/{name}.sock" for name in ("router", "engine", "tokenizer-0", "control")}
        self.addresses = {"router": at["router"], "engine": at["engine"], "tokenizers": at["tokenizer-0"],
                          "control": at["control"]}
        self.sockets = {"router": self._bind(zmq.ROUTER, at["router"]), "engine": self._bind(zmq.PULL, at["engine"]),
                        "tokenizer": self._bind(zmq.PULL, at["tokenizer-0"])}
        self.control = self._bind(zmq.PUB, at["control"])
        self.received: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.running = True
        self.welcoming = True   # False: Hello is counted and left unanswered (a router that cannot route yet)
        self.hellos = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _bind(self, kind: int, address: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    def send_raw(self, identity: bytes, frame: bytes) -> None:
        self.outbox.put((identity, frame))

    def send(self, identity: bytes, message: Any) -> None:
        self.send_raw(identity, protocol.encode(message))

    def announce(self, message: Any) -> None:
        self.outbox.put((None, protocol.encode(message)))

    def next(self, kind: type, timeout: float = 5.0) -> Any:
        """The next received message of `kind` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            _, message = self.received.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(message, kind):
                return message

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in self.sockets.values():
            poller.register(sock, zmq.POLLIN)
        decoder = protocol.Decoder(protocol.AnyMessage)
        while self.running:
            while not self.outbox.empty():
                identity, frame = self.outbox.get()
                if identity is None:
                    self.control.send(frame)
                else:
                    self.sockets["router"].send_multipart([identity, frame])
            for sock, _ in poller.poll(10):
                frames = sock.recv_multipart()
                message = decoder.decode(frames[-1])
                stage = {v: k for k, v in self.sockets.items()}[sock]
                if stage == "router":
                    identity = frames[0]
                    if isinstance(message, protocol.Hello):
                        self.hellos += 1
                        if not self.welcoming:
                            continue
                        self.sockets["router"].send_multipart([identity, protocol.encode(
                            protocol.Welcome(model="scripted", addresses=self.addresses))])
                        continue
                    stage, message.reply_to = "detokenizer", identity
                self.received.put((stage, message))
                for reply in self.script(stage, message):
                    self.sockets["router"].send_multipart([message.reply_to, protocol.encode(reply)])

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.ctx.destroy(0)
