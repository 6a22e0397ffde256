"""The raw ZeroMQ client for RL rollouts: token ids in, token ids + logprobs + versions out.

It needs one address, the detokenizer's ROUTER (`router`); the server's Welcome tells it the
engine, tokenizer and control addresses. Token-id prompts go straight to the engine; text and
chat prompts go through a tokenizer. If a stage serving its requests dies, every pending
request ends with `StageFailure` (retryable) instead of waiting forever.

    with Client("ipc:///tmp/parallm-xyz/router.sock") as client:
        result = client.generate([1, 2, 3], SamplingParams(max_tokens=32, logprobs=True), n=4)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

import zmq
import zmq.asyncio

from . import protocol
from .protocol import SamplingParams
from .transport import open_socket

Prompt = Sequence[int] | str | list[dict[str, Any]]


class ClientError(RuntimeError):
    """The server refused or failed a request."""

    def __init__(self, message: str, *, status: int = 400, code: str = "", retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retryable = retryable


class StageFailure(ClientError):
    """A stage died while the request was in flight; the same request may be retried."""


@dataclass
class SequenceResult:
    """One finished (or aborted) sample: everything an RL trainer needs about it."""

    rid: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    adapter: str = ""
    versions: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: protocol.Usage | None = None

    def add(self, out: protocol.Output) -> None:
        ids = protocol.unpack_ids(out.token_ids)
        if ids:
            protocol.extend_spans(self.versions, len(self.token_ids), out.version)
        self.token_ids.extend(ids)
        if out.logprobs:
            self.logprobs.extend(protocol.unpack_floats(out.logprobs))
        self.top_logprobs.extend(protocol.unpack_top(out.top_ids, out.top_logprobs, len(ids)))
        self.text += out.text
        self.adapter = out.adapter or self.adapter
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.usage = out.usage

    def version_of(self, position: int) -> int:
        """The policy version that produced token `position`."""
        return protocol.version_at(self.versions, position)


def _error(message: protocol.RequestError) -> ClientError:
    cls = StageFailure if message.retryable and message.status >= 500 else ClientError
    return cls(message.message, status=message.status, code=message.code, retryable=message.retryable)


def _new_rid() -> str:
    return uuid.uuid4().hex


def _submit_message(rid: str, reply_to: bytes, prompt: Prompt, params: SamplingParams | None, n: int,
                    detok: bool, extra: dict[str, Any]) -> tuple[str, protocol.Message]:
    """The Submit (token ids, straight to the engine) or TextSubmit (text or chat, through a
    tokenizer) for a prompt; `extra` holds other RequestSpec fields (adapter, priority, metadata, ...)."""
    detok_options = extra.pop("detok_options", {})
    spec = protocol.RequestSpec(params=params or SamplingParams(), n=n,
                                detok=protocol.DetokSpec(**detok_options) if detok else None,
                                submitted_at=time.time(), **extra)
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
        text = {"prompt": prompt} if isinstance(prompt, str) else {"messages": list(prompt)}
        return "tokenizer", protocol.TextSubmit(rid=rid, reply_to=reply_to, spec=spec, **text)
    return "engine", protocol.Submit(rid=rid, reply_to=reply_to, prompt_ids=protocol.pack_ids(prompt), spec=spec)


class Client:
    """Synchronous client. One instance per thread."""

    def __init__(self, router: str, *, timeout: float = 600.0, identity: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.identity = (identity or f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}").encode()
        self.timeout = timeout
        self.dealer = open_socket(self.ctx, zmq.DEALER, router, bind=False, identity=self.identity)
        self._decoder = protocol.Decoder(protocol.ClientInbound)
        self._control_decoder = protocol.Decoder(protocol.ControlMessage)
        self.welcome = self._hello()
        addrs = self.welcome.addresses
        self._engine = open_socket(self.ctx, zmq.PUSH, addrs["engine"], bind=False)
        self._tokenizers = open_socket(self.ctx, zmq.PUSH, addrs["tokenizers"].split(","), bind=False)
        self._control = open_socket(self.ctx, zmq.SUB, addrs["control"], bind=False)
        self._control.setsockopt(zmq.SUBSCRIBE, b"")
        self._poller = zmq.Poller()
        self._poller.register(self.dealer, zmq.POLLIN)
        self._poller.register(self._control, zmq.POLLIN)
        self._inbox: dict[str, list[Any]] = {}
        self._samples: dict[str, int] = {}
        self._replies: dict[str, protocol.Reply | protocol.RequestError] = {}
        self._qids = itertools.count()

    def _hello(self) -> protocol.Welcome:
        deadline = time.monotonic() + min(self.timeout, 30.0)
        while time.monotonic() < deadline:
            self.dealer.send(protocol.encode(protocol.Hello(client=self.identity.decode())))
            if self.dealer.poll(500, zmq.POLLIN):
                message = self._decoder.decode(self.dealer.recv())
                if isinstance(message, protocol.Welcome):
                    return message
        raise ClientError("no Welcome from the server's router (is parallm-launch running?)", status=503,
                          retryable=True)

    @property
    def model(self) -> str:
        return self.welcome.model

    # ------------------------------------------------------------------ plumbing
    def _send(self, target: str, message: protocol.Message) -> None:
        sock = self._engine if target == "engine" else self._tokenizers
        sock.send(protocol.encode(message))

    def _pump(self, timeout_s: float) -> None:
        for sock, _ in self._poller.poll(int(timeout_s * 1000)):
            if sock is self._control:
                message = self._control_decoder.decode(self._control.recv())
                if isinstance(message, protocol.StageDown):
                    failure = protocol.RequestError(rid="", status=503, code="stage_restarted", retryable=True,
                                                    message=f"stage {message.stage} died; retry the request")
                    for queue in self._inbox.values():
                        queue.append(failure)
                continue
            message = self._decoder.decode(self.dealer.recv())
            if isinstance(message, protocol.Outputs):
                for item in message.items:
                    if item.rid in self._inbox:
                        self._inbox[item.rid].append(item)
            elif isinstance(message, protocol.RequestError):
                if message.rid in self._inbox:
                    self._inbox[message.rid].append(message)
                else:
                    self._replies[message.rid] = message
            elif isinstance(message, protocol.REPLIES):
                self._replies[message.qid] = message

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1, detok: bool = False,
               rid: str | None = None, **extra: Any) -> str:
        """Send one request; read its outputs with `stream(rid)` or `result(rid)`."""
        rid = rid or _new_rid()
        target, message = _submit_message(rid, self.identity, prompt, params, n, detok, extra)
        self._inbox[rid] = []
        self._samples[rid] = n
        self._send(target, message)
        return rid

    def stream(self, rid: str) -> Iterator[protocol.Output]:
        """Outputs of a submitted request as they arrive, until every sample finished."""
        remaining = self._samples.pop(rid)
        deadline = time.monotonic() + self.timeout
        try:
            while remaining:
                queue = self._inbox[rid]
                while queue:
                    item = queue.pop(0)
                    if isinstance(item, protocol.RequestError):
                        raise _error(item)
                    if item.finish_reason is not None:
                        remaining -= 1
                    yield item
                if remaining:
                    if time.monotonic() > deadline:
                        raise ClientError(f"request {rid} timed out after {self.timeout:.0f} s", status=504,
                                          retryable=True)
                    self._pump(0.05)
        finally:
            self._inbox.pop(rid, None)
            if remaining:
                self.abort([rid])

    def result(self, rid: str) -> list[SequenceResult]:
        results: dict[int, SequenceResult] = {}
        for out in self.stream(rid):
            results.setdefault(out.index, SequenceResult(rid=rid, index=out.index)).add(out)
        return [results[i] for i in sorted(results)]

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1,
                 detok: bool = False, **extra: Any) -> list[SequenceResult]:
        """One prompt, n samples, whole results."""
        return self.result(self.submit(prompt, params, n=n, detok=detok, **extra))

    def generate_group(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *, n: int = 1,
                       detok: bool = False, **extra: Any) -> list[list[SequenceResult]]:
        """Every prompt x n samples, submitted together so they batch; results in prompt order."""
        rids = [self.submit(p, params, n=n, detok=detok, **dict(extra)) for p in prompts]
        return [self.result(rid) for rid in rids]

    def abort(self, rids: Sequence[str] = (), *, all: bool = False) -> None:
        self._send("engine", protocol.Abort(rids=list(rids), all=all))

    def _call(self, target: str, message: Any) -> Any:
        message.qid, message.reply_to = f"q{next(self._qids)}-{uuid.uuid4().hex[:6]}", self.identity
        self._send(target, message)
        deadline = time.monotonic() + min(self.timeout, 120.0)
        while message.qid not in self._replies:
            if time.monotonic() > deadline:
                raise ClientError(f"no reply to {type(message).__name__}", status=504, retryable=True)
            self._pump(0.05)
        reply = self._replies.pop(message.qid)
        if isinstance(reply, protocol.RequestError):
            raise _error(reply)
        return reply

    def stats(self) -> protocol.EngineStats:
        return self._call("engine", protocol.GetStats(qid="")).stats

    def policy(self) -> dict[str, int]:
        """The latest version of every adapter ("" = the base model, 0)."""
        return {"": 0, **self.list_adapters().policy}

    def list_adapters(self) -> protocol.AdapterList:
        return self._call("engine", protocol.ListAdapters(qid="", reply_to=b""))

    def pause(self, mode: str = "keep") -> protocol.PauseState:
        return self._call("engine", protocol.Pause(mode=mode))

    def resume(self) -> protocol.PauseState:
        return self._call("engine", protocol.Resume())

    def score(self, ids: Sequence[int], *, start: int = 1, top_logprobs: int = 0) -> dict[str, Any]:
        """Teacher-forced logprobs of ids[start:] under the current policy."""
        reply = self._call("engine", protocol.Score(qid="", reply_to=b"", ids=protocol.pack_ids(ids), start=start,
                                                     top_logprobs=top_logprobs))
        out: dict[str, Any] = {"logprobs": protocol.unpack_floats(reply.logprobs)}
        if reply.top_ids:
            out["top_ids"] = protocol.unpack_ids(reply.top_ids)
            out["top_logprobs"] = protocol.unpack_floats(reply.top_logprobs)
        return out

    def close(self) -> None:
        for sock in (self.dealer, self._engine, self._tokenizers, self._control):
            sock.close(0)
        self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """asyncio client: many concurrent requests from one event loop."""

    def __init__(self, router: str, *, timeout: float = 600.0, identity: str | None = None) -> None:
        self.router = router
        self.timeout = timeout
        self.identity = (identity or f"aclient-{os.getpid()}-{uuid.uuid4().hex[:8]}").encode()
        self.ctx = zmq.asyncio.Context()
        self._decoder = protocol.Decoder(protocol.ClientInbound)
        self._control_decoder = protocol.Decoder(protocol.ControlMessage)
        self._queues: dict[str, asyncio.Queue] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self.welcome: protocol.Welcome | None = None

    async def connect(self) -> "AsyncClient":
        self.dealer = open_socket(self.ctx, zmq.DEALER, self.router, bind=False, identity=self.identity)
        deadline = time.monotonic() + min(self.timeout, 30.0)
        while self.welcome is None:
            if time.monotonic() > deadline:
                raise ClientError("no Welcome from the server's router", status=503, retryable=True)
            await self.dealer.send(protocol.encode(protocol.Hello(client=self.identity.decode())))
            if await self.dealer.poll(500, zmq.POLLIN):
                message = self._decoder.decode(await self.dealer.recv())
                if isinstance(message, protocol.Welcome):
                    self.welcome = message
        addrs = self.welcome.addresses
        self._engine = open_socket(self.ctx, zmq.PUSH, addrs["engine"], bind=False)
        self._tokenizers = open_socket(self.ctx, zmq.PUSH, addrs["tokenizers"].split(","), bind=False)
        self._control = open_socket(self.ctx, zmq.SUB, addrs["control"], bind=False)
        self._control.setsockopt(zmq.SUBSCRIBE, b"")
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        return self

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _read(self) -> None:
        while True:
            message = self._decoder.decode(await self.dealer.recv())
            if isinstance(message, protocol.Outputs):
                for item in message.items:
                    queue = self._queues.get(item.rid)
                    if queue is not None:
                        queue.put_nowait(item)
            elif isinstance(message, protocol.RequestError):
                queue = self._queues.get(message.rid)
                if queue is not None:
                    queue.put_nowait(message)
                future = self._replies.pop(message.rid, None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, protocol.REPLIES):
                future = self._replies.pop(message.qid, None)
                if future is not None and not future.done():
                    future.set_result(message)

    async def _watch(self) -> None:
        while True:
            message = self._control_decoder.decode(await self._control.recv())
            if isinstance(message, protocol.StageDown):
                failure = protocol.RequestError(rid="", status=503, code="stage_restarted", retryable=True,
                                                message=f"stage {message.stage} died; retry the request")
                for queue in self._queues.values():
                    queue.put_nowait(failure)

    async def _send(self, target: str, message: protocol.Message) -> None:
        sock = self._engine if target == "engine" else self._tokenizers
        await sock.send(protocol.encode(message))

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1,
                     detok: bool = False, rid: str | None = None, **extra: Any) -> AsyncIterator[protocol.Output]:
        rid = rid or _new_rid()
        target, message = _submit_message(rid, self.identity, prompt, params, n, detok, extra)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        remaining = n
        try:
            await self._send(target, message)
            while remaining:
                item = await asyncio.wait_for(queue.get(), self.timeout)
                if isinstance(item, protocol.RequestError):
                    raise _error(item)
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self._queues.pop(rid, None)
            if remaining:
                await self._send("engine", protocol.Abort(rids=[rid]))

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1,
                       detok: bool = False, **extra: Any) -> list[SequenceResult]:
        results: dict[int, SequenceResult] = {}
        rid = extra.pop("rid", None) or _new_rid()
        async for out in self.stream(prompt, params, n=n, detok=detok, rid=rid, **extra):
            results.setdefault(out.index, SequenceResult(rid=rid, index=out.index)).add(out)
        return [results[i] for i in sorted(results)]

    async def generate_group(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                             n: int = 1, detok: bool = False, **extra: Any) -> list[list[SequenceResult]]:
        return list(await asyncio.gather(*(self.generate(p, params, n=n, detok=detok, **dict(extra))
                                           for p in prompts)))

    async def abort(self, rids: Sequence[str] = (), *, all: bool = False) -> None:
        await self._send("engine", protocol.Abort(rids=list(rids), all=all))

    async def _call(self, target: str, message: Any) -> Any:
        message.qid, message.reply_to = _new_rid(), self.identity
        future = asyncio.get_running_loop().create_future()
        self._replies[message.qid] = future
        await self._send(target, message)
        reply = await asyncio.wait_for(future, min(self.timeout, 120.0))
        if isinstance(reply, protocol.RequestError):
            raise _error(reply)
        return reply

    async def stats(self) -> protocol.EngineStats:
        return (await self._call("engine", protocol.GetStats(qid=""))).stats

    async def policy(self) -> dict[str, int]:
        return {"": 0, **(await self._call("engine", protocol.ListAdapters(qid="", reply_to=b""))).policy}

    async def pause(self, mode: str = "keep") -> protocol.PauseState:
        return await self._call("engine", protocol.Pause(mode=mode))

    async def resume(self) -> protocol.PauseState:
        return await self._call("engine", protocol.Resume())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for name in ("dealer", "_engine", "_tokenizers", "_control"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(0)
        self.ctx.term()
