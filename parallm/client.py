"""The raw ZeroMQ client for RL rollouts: token ids in, token ids + logprobs + versions out.

It needs one address, the detokenizer's ROUTER (`router`); the server's Welcome tells it the
engine, tokenizer and control addresses. Token-id prompts go straight to the engine; text and
chat prompts go through a tokenizer. If a stage serving its requests dies, every request it held
ends with `StageFailure` (retryable) instead of waiting forever.

`AsyncClient` is the asyncio client, built on the one pipeline connection (parallm/pipeline.py)
that ingress uses too; `Client` offers the same operations as blocking calls, running an
AsyncClient on a private event loop in a background thread (so one Client may be shared by
threads).

    with Client("ipc:///tmp/parallm-xyz/router.sock") as client:
        result = client.generate([1, 2, 3], SamplingParams(max_tokens=32, logprobs=True), n=4)
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Coroutine, Iterator, Literal, Mapping, Sequence, TypeVar

from . import protocol
from .client_messages import Prompt, adapter_message, request_message
from .keys import Curve, client_curve
from .pipeline import Pipeline
from .protocol import SamplingParams
from .streams import ClientError, RequestStream, StageFailure

__all__ = ["AsyncClient", "Client", "ClientError", "SequenceResult", "StageFailure"]

Stage = Literal["engine", "tokenizer", "detokenizer"]
RPC_TIMEOUT_S = 120.0
T = TypeVar("T")


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
    pooled: list[float] = field(default_factory=list)  # a pooling request's vector (RequestSpec.pooling)

    def add(self, out: protocol.Output) -> None:
        if out.pooled:
            self.pooled = protocol.unpack_floats(out.pooled)
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


async def _collect(stream: RequestStream) -> list[SequenceResult]:
    results: dict[int, SequenceResult] = {}
    try:
        async for out in stream:
            results.setdefault(out.index, SequenceResult(rid=stream.rid, index=out.index)).add(out)
    finally:
        stream.close()
    return [results[i] for i in sorted(results)]


def _curve(server_key: str | None, client_key: str | None) -> Curve | None:
    """CURVE keys for a tcp:// server (docs/protocol.md, Security): the server's public key file and
    this client's NAME.key_secret file, both or neither."""
    if bool(server_key) != bool(client_key):
        raise ValueError("give both server_key (the server's public key file) and client_key (this client's "
                         "NAME.key_secret file), or neither")
    return client_curve(server_key, client_key) if server_key and client_key else None


class AsyncClient:
    """asyncio client: many concurrent requests from one event loop (`async with AsyncClient(router)`).

    `timeout` bounds the wait for a request's next output (then it is aborted: StageFailure 504) and,
    up to RPC_TIMEOUT_S, for a control request's reply."""

    def __init__(self, router: str, *, timeout: float = 600.0, identity: str | None = None,
                 server_key: str | None = None, client_key: str | None = None) -> None:
        self.router = router
        self.timeout = timeout
        self.identity = (identity or f"aclient-{os.getpid()}-{uuid.uuid4().hex[:8]}").encode()
        curve = _curve(server_key, client_key)
        self._pipeline = Pipeline(router, identity=self.identity, hello_timeout_s=min(timeout, 30.0), curve=curve)
        self.welcome: protocol.Welcome | None = None
        self._submitted: dict[str, RequestStream] = {}

    async def connect(self) -> "AsyncClient":
        """Hello until the router's Welcome (StageFailure if none within min(timeout, 30 s))."""
        if self.welcome is None:
            self.welcome = await self._pipeline.connect()
        return self

    async def close(self) -> None:
        """Close the sockets; the server aborts what this client still had running."""
        self._submitted.clear()
        await self._pipeline.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def model(self) -> str:
        return self.welcome.model if self.welcome else ""

    # ------------------------------------------------------------------ requests
    async def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1, detok: bool = False,
                     rid: str | None = None, **spec: Any) -> str:
        """Send one request; read its outputs with `stream(rid)` or `result(rid)`. `spec`: other
        RequestSpec fields (adapter, adapter_version, min_version, max_staleness, priority, metadata)."""
        rid = rid or uuid.uuid4().hex
        if rid in self._submitted:
            raise ValueError(f"request id {rid!r} was already submitted")
        self._submitted[rid] = await self._open(rid, prompt, params, n, detok, spec)
        return rid

    async def stream(self, request: Prompt, params: SamplingParams | None = None, *, n: int = 1,
                     detok: bool = False, rid: str | None = None, **spec: Any) -> AsyncIterator[protocol.Output]:
        """Outputs as they arrive, until every sample finished: of the submitted request whose id
        `request` is (a str naming a request that is waiting to be read), or of a new request
        (`request` any other prompt, the other arguments as in `submit`).
        Leaving the loop early aborts the request once the generator is closed: at once under
        `contextlib.aclosing`, else on the event loop's next turn after it is dropped."""
        stream = self._take(request, params, n, detok, rid, spec)
        if stream is None:
            stream = await self._open(rid or uuid.uuid4().hex, request, params, n, detok, spec)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def result(self, rid: str) -> list[SequenceResult]:
        """Every sample of a submitted request, whole, in index order."""
        stream = self._submitted.pop(rid, None)
        if stream is None:
            raise ValueError(f"no submitted request {rid!r} to read (already read?)")
        return await _collect(stream)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1,
                       detok: bool = False, rid: str | None = None, **spec: Any) -> list[SequenceResult]:
        """One prompt, n samples, whole results."""
        return await _collect(await self._open(rid or uuid.uuid4().hex, prompt, params, n, detok, spec))

    async def generate_group(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                             n: int = 1, detok: bool = False, **spec: Any) -> list[list[SequenceResult]]:
        """Every prompt x n samples, submitted together so they batch; results in prompt order."""
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                streams.append(await self._open(uuid.uuid4().hex, prompt, params, n, detok, spec))
            return [await _collect(stream) for stream in streams]
        finally:
            for stream in streams:
                stream.close()

    async def pool(self, inputs: Sequence[Prompt], model: str, *, task: protocol.PoolingTask = "embed",
                   dimensions: int = 0, **spec: Any) -> list[list[float]]:
        """A served pooling model's vector per input (text, chat messages or token ids), in input order: an
        embedding, [reward] or class logits. The inputs go together, so they batch in one pass."""
        pooling = protocol.PoolingSpec(model=model, task=task, dimensions=dimensions)
        results = await self.generate_group(list(inputs), SamplingParams(max_tokens=0), pooling=pooling, **spec)
        vectors = []
        for (result,) in results:
            if not result.pooled:
                raise StageFailure(f"pooling request {result.rid} ended ({result.finish_reason}) without a vector",
                                   status=503, code="aborted", retryable=True)
            vectors.append(result.pooled)
        return vectors

    async def abort(self, rids: Sequence[str] = (), *, all: bool = False) -> None:
        """End requests (their last output says finish_reason "abort"), or every request of the server."""
        if isinstance(rids, str):
            raise TypeError("abort takes a list of request ids")
        if not self._pipeline.abort(rids, all=all):
            raise StageFailure("the engine's queue is full (or the client is closed)", status=503,
                               code="overloaded", retryable=True)

    async def _open(self, rid: str, prompt: Prompt, params: SamplingParams | None, n: int, detok: bool,
                    spec: Mapping[str, Any]) -> RequestStream:
        return await self._pipeline.open(request_message(rid, prompt, params, n, detok, spec), timeout=self.timeout)

    def _take(self, request: Any, params: Any, n: int, detok: bool, rid: Any, spec: Mapping[str, Any]
              ) -> RequestStream | None:
        """The submitted request `request` names, taken out of the table (None: `request` is a prompt)."""
        if not isinstance(request, str) or request not in self._submitted:
            return None
        if params is not None or n != 1 or detok or rid is not None or spec:
            raise TypeError("stream(rid) of a submitted request takes no other arguments")
        return self._submitted.pop(request)

    # ------------------------------------------------------------------ control
    async def _call(self, target: Stage, message: Any) -> Any:
        return await self._pipeline.call(target, message, timeout=min(self.timeout, RPC_TIMEOUT_S))

    async def score(self, ids: Sequence[int], *, start: int = 1, top_logprobs: int = 0, adapter: str = "",
                    adapter_version: int = 0) -> dict[str, Any]:
        """Teacher-forced logprobs of ids[start:] (raw model distribution) under the current policy:
        {"logprobs": [...]} plus flat "top_ids"/"top_logprobs" (k per position) when asked."""
        reply = await self._call("engine", protocol.Score(qid="", reply_to=b"", ids=protocol.pack_ids(ids), start=start,
                                                          top_logprobs=top_logprobs, adapter=adapter,
                                                          adapter_version=adapter_version))
        out: dict[str, Any] = {"logprobs": protocol.unpack_floats(reply.logprobs)}
        if reply.top_ids:
            out["top_ids"] = protocol.unpack_ids(reply.top_ids)
            out["top_logprobs"] = protocol.unpack_floats(reply.top_logprobs)
        return out

    async def stats(self, stage: Stage = "engine") -> protocol.StageStats:
        """A stage's stats: EngineStats, TokenizerStats (one tokenizer) or DetokenizerStats."""
        if stage not in ("engine", "tokenizer", "detokenizer"):
            raise ValueError(f"no stage {stage!r}; one of engine, tokenizer, detokenizer")
        return (await self._call(stage, protocol.GetStats(qid=""))).stats

    async def policy(self) -> dict[str, int]:
        """The latest version of every adapter ("" = the base model, 0)."""
        return {"": 0, **(await self.list_adapters()).policy}

    async def list_adapters(self) -> protocol.AdapterList:
        return await self._call("engine", protocol.ListAdapters(qid="", reply_to=b""))

    async def load_adapter(self, name: str, version: int = 0, weights: Any = b"",
                           config: Mapping[str, Any] | None = None, *, format: str = "auto",
                           make_default: bool = False) -> protocol.AdapterLoaded:
        """Load an adapter version and wait until the engine has it (the message a trainer publishes,
        answered). `version` 0: latest + 1. `weights`: safetensors bytes, tensors by name, or a path
        the engine can read."""
        return await self._call("engine", adapter_message(name, version, weights, config, format, make_default))

    async def unload_adapter(self, name: str) -> protocol.AdapterUnloaded:
        return await self._call("engine", protocol.AdapterUnload(name=name))

    async def pause(self, mode: Literal["keep", "abort"] = "keep") -> protocol.PauseState:
        return await self._call("engine", protocol.Pause(mode=mode))

    async def resume(self) -> protocol.PauseState:
        return await self._call("engine", protocol.Resume())

    async def tokenize(self, prompt: str | list[dict[str, Any]], *, add_generation_prompt: bool = True,
                       add_special_tokens: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None
                       ) -> list[int]:
        """Token ids of a text prompt, or of chat messages rendered by the model's chat template."""
        text = {"prompt": prompt} if isinstance(prompt, str) else {"messages": list(prompt)}
        reply = await self._call("tokenizer", protocol.Tokenize(
            qid="", reply_to=b"", add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens,
            chat_template_kwargs=dict(chat_template_kwargs or {}), **text))
        return protocol.unpack_ids(reply.ids)

    async def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        reply = await self._call("tokenizer", protocol.Detokenize(qid="", reply_to=b"", ids=protocol.pack_ids(ids),
                                                                  skip_special_tokens=skip_special_tokens))
        return reply.text


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Client:
    """Blocking client: the AsyncClient's operations, each run on a private event loop in a background
    thread (one hop per call; `stream` hops once per batch of outputs). Thread-safe."""

    def __init__(self, router: str, *, timeout: float = 600.0, identity: str | None = None,
                 server_key: str | None = None, client_key: str | None = None) -> None:
        self._client = AsyncClient(router, timeout=timeout,
                                   identity=identity or f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                                   server_key=server_key, client_key=client_key)
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="parallm-client", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.connect()
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise ClientError("the client is closed", status=499, code="client_closed")
        done, state = threading.Lock(), {}
        done.acquire()

        def start() -> None:  # on the loop: run it as a task, release the caller when it ends
            if state.get("cancelled"):
                coro.close()
                return
            task = state["task"] = self._loop.create_task(coro)
            task.add_done_callback(lambda _: done.release())

        def cancel() -> None:  # on the loop, after start(): what the call sent is aborted
            state["cancelled"] = True
            if "task" in state:
                state["task"].cancel()

        self._loop.call_soon_threadsafe(start)
        try:
            done.acquire()  # (run_coroutine_threadsafe's future chaining costs ~10 us more per call)
        except BaseException:  # interrupted (Ctrl-C) while waiting
            self._loop.call_soon_threadsafe(cancel)
            raise
        return state["task"].result()

    def _stop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def connect(self) -> "Client":
        """Hello until the router's Welcome (done by the constructor)."""
        self._run(self._client.connect())
        return self

    def close(self) -> None:
        """Close the sockets and stop the thread; the server aborts what this client still had running."""
        if self._closed:
            return
        try:
            self._run(self._client.close())
            self._run(self._loop.shutdown_asyncgens())
        finally:
            self._stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def router(self) -> str:
        return self._client.router

    @property
    def timeout(self) -> float:
        return self._client.timeout

    @property
    def identity(self) -> bytes:
        return self._client.identity

    @property
    def welcome(self) -> protocol.Welcome | None:
        return self._client.welcome

    @property
    def model(self) -> str:
        return self._client.model

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1, detok: bool = False,
               rid: str | None = None, **spec: Any) -> str:
        return self._run(self._client.submit(prompt, params, n=n, detok=detok, rid=rid, **spec))

    def stream(self, request: Prompt, params: SamplingParams | None = None, *, n: int = 1,
               detok: bool = False, rid: str | None = None, **spec: Any) -> Iterator[protocol.Output]:
        client = self._client
        stream = client._take(request, params, n, detok, rid, spec)
        if stream is None:
            stream = self._run(client._open(rid or uuid.uuid4().hex, request, params, n, detok, spec))
        try:
            while batch := self._run(stream.batch()):
                yield from batch
        finally:
            if not self._closed:
                try:
                    self._loop.call_soon_threadsafe(stream.close)
                except RuntimeError:  # closed meanwhile: the server aborts what the client left
                    pass

    def result(self, rid: str) -> list[SequenceResult]:
        return self._run(self._client.result(rid))

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1,
                 detok: bool = False, rid: str | None = None, **spec: Any) -> list[SequenceResult]:
        return self._run(self._client.generate(prompt, params, n=n, detok=detok, rid=rid, **spec))

    def generate_group(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                       n: int = 1, detok: bool = False, **spec: Any) -> list[list[SequenceResult]]:
        return self._run(self._client.generate_group(prompts, params, n=n, detok=detok, **spec))

    def pool(self, inputs: Sequence[Prompt], model: str, *, task: protocol.PoolingTask = "embed",
             dimensions: int = 0, **spec: Any) -> list[list[float]]:
        return self._run(self._client.pool(inputs, model, task=task, dimensions=dimensions, **spec))

    def abort(self, rids: Sequence[str] = (), *, all: bool = False) -> None:
        return self._run(self._client.abort(rids, all=all))

    # ------------------------------------------------------------------ control
    def score(self, ids: Sequence[int], *, start: int = 1, top_logprobs: int = 0, adapter: str = "",
              adapter_version: int = 0) -> dict[str, Any]:
        return self._run(self._client.score(ids, start=start, top_logprobs=top_logprobs, adapter=adapter,
                                            adapter_version=adapter_version))

    def stats(self, stage: Stage = "engine") -> protocol.StageStats:
        return self._run(self._client.stats(stage))

    def policy(self) -> dict[str, int]:
        return self._run(self._client.policy())

    def list_adapters(self) -> protocol.AdapterList:
        return self._run(self._client.list_adapters())

    def load_adapter(self, name: str, version: int = 0, weights: Any = b"",
                     config: Mapping[str, Any] | None = None, *, format: str = "auto",
                     make_default: bool = False) -> protocol.AdapterLoaded:
        # serialized here: MLX evaluates arrays only on a thread that has its stream
        return self._run(self._client._call("engine", adapter_message(name, version, weights, config, format,
                                                                      make_default)))

    def unload_adapter(self, name: str) -> protocol.AdapterUnloaded:
        return self._run(self._client.unload_adapter(name))

    def pause(self, mode: Literal["keep", "abort"] = "keep") -> protocol.PauseState:
        return self._run(self._client.pause(mode))

    def resume(self) -> protocol.PauseState:
        return self._run(self._client.resume())

    def tokenize(self, prompt: str | list[dict[str, Any]], *, add_generation_prompt: bool = True,
                 add_special_tokens: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None
                 ) -> list[int]:
        return self._run(self._client.tokenize(prompt, add_generation_prompt=add_generation_prompt,
                                               add_special_tokens=add_special_tokens,
                                               chat_template_kwargs=chat_template_kwargs))

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._run(self._client.detokenize(ids, skip_special_tokens=skip_special_tokens))
