"""Shared by the tests/test_api_*.py files (no tests here): a scripted Backend for the HTTP layer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from parallm.api.backend import BackendError
from parallm.protocol import (AdapterList, AdapterLoaded, AdapterPublish, AdapterUnloaded, Detokenize, EngineStats, Output,
                              PauseState, PrefixCacheReset, TextSubmit, Tokenize, Usage, WeightsUpdate, WeightsUpdated,
                              pack_floats, pack_ids, unpack_ids)

MODEL = "test-model"


def words_script(words: list[str], prompt_tokens: int = 5, finish: str = "length",
                 base_id: int = 100) -> Callable[[TextSubmit], list[Output]]:
    """Each sample j emits `words` (one token each, suffixed by j when n > 1), then finishes."""

    def script(submit: TextSubmit) -> list[Output]:
        outs = []
        spec = submit.spec
        for j in range(spec.n):
            suffix = str(j) if spec.n > 1 else ""
            for k, word in enumerate(words):
                last = k == len(words) - 1
                out = Output(rid=submit.rid, index=j, token_ids=pack_ids([base_id + k]), text=word + suffix)
                if spec.params.logprobs:
                    out.logprobs = pack_floats([-0.5 - k])
                    out.tokens = [word + suffix]
                    top = spec.params.top_logprobs
                    if top:
                        out.top_ids = pack_ids([base_id + k + t for t in range(top)])
                        out.top_logprobs = pack_floats([-0.5 - k - t for t in range(top)])
                        out.top_tokens = [(word + suffix) if t == 0 else f"alt{t}" for t in range(top)]
                if k == 0 and spec.detok is not None and spec.detok.echo:
                    out.prompt_text = submit.prompt if submit.prompt is not None else "<ids>"
                    out.prompt_ids = pack_ids(list(range(1, prompt_tokens + 1)))
                    if spec.params.prompt_logprobs is not None:
                        out.prompt_logprobs = pack_floats([float("nan")] + [-1.0] * (prompt_tokens - 1))
                        out.prompt_tokens = [f"p{i}" for i in range(prompt_tokens)]
                if last:
                    out.finish_reason = finish  # type: ignore[assignment]
                    out.usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=len(words))
                outs.append(out)
        # interleave the samples, as the engine does
        return sorted(outs, key=lambda o: (unpack_first(o), o.index))

    return script


def unpack_first(out: Output) -> int:
    return unpack_ids(out.token_ids)[0]


class ScriptedIterator:
    """The async iterator generate() returns; records whether it was closed (aclose aborts)."""

    def __init__(self, backend: "FakeBackend", items: list[Any], hang_after: int | None) -> None:
        self.backend, self.items, self.hang_after = backend, list(items), hang_after
        self.sent = 0
        self.closed = False

    def __aiter__(self) -> "ScriptedIterator":
        return self

    async def __anext__(self) -> Output:
        if self.closed:
            raise StopAsyncIteration
        if self.hang_after is not None and self.sent >= self.hang_after:
            self.backend.hanging.set()
            await asyncio.Event().wait()
        if self.backend.delay:
            await asyncio.sleep(self.backend.delay)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        self.sent += 1
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True
        self.backend.closed.append(self)


@dataclass
class FakeBackend:
    """Implements parallm.api.backend.Backend from scripts."""

    script: Callable[[TextSubmit], list[Any]] = field(default_factory=lambda: words_script(["Hello", " world"]))
    model_name: str = MODEL
    max_model_len: int = 2048
    status: str = "ok"
    hang_after: int | None = None          # outputs before generate() blocks forever
    delay: float = 0.0
    error_at_start: BackendError | None = None
    submits: list[TextSubmit] = field(default_factory=list)
    iterators: list[ScriptedIterator] = field(default_factory=list)
    closed: list[ScriptedIterator] = field(default_factory=list)
    tokenize_calls: list[dict[str, Any]] = field(default_factory=list)
    controls: list[tuple[str, Any]] = field(default_factory=list)
    policy: dict[str, int] = field(default_factory=dict)
    default_max_tokens: int = 256
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    max_n: int = 128
    max_constraint_bytes: int = 65536
    last_batch_size: int = 0
    pooling_models: dict[str, Any] = field(default_factory=dict)
    hanging: asyncio.Event = field(default_factory=asyncio.Event)

    def generate(self, submit: TextSubmit) -> AsyncIterator[Output]:
        self.submits.append(submit)
        items = [self.error_at_start] if self.error_at_start else self.script(submit)
        it = ScriptedIterator(self, items, self.hang_after)
        self.iterators.append(it)
        return it

    async def tokenize(self, request: Tokenize) -> list[int]:
        fields = {name: getattr(request, name) for name in ("prompt", "messages", "add_generation_prompt",
                                                             "add_special_tokens", "chat_template_kwargs")}
        self.tokenize_calls.append(fields)
        text = fields.get("prompt") or "".join(m["content"] for m in fields["messages"])
        return [ord(c) for c in text]

    async def detokenize(self, request: Detokenize) -> str:
        return "".join(chr(i) for i in unpack_ids(request.ids))

    async def engine_stats(self) -> EngineStats:
        return EngineStats()

    async def pause(self, mode: str) -> PauseState:
        self.controls.append(("pause", mode))
        return PauseState(qid="", paused=True, mode=mode)  # type: ignore[arg-type]

    async def resume(self) -> PauseState:
        self.controls.append(("resume", None))
        return PauseState(qid="", paused=False)

    async def abort(self, rids: list[str], *, all: bool = False) -> None:
        self.controls.append(("abort", (list(rids), all)))

    async def load_adapter(self, request: AdapterPublish) -> AdapterLoaded:
        raise BackendError(501, "not_implemented", "no adapters in the fake backend")

    async def unload_adapter(self, name: str) -> AdapterUnloaded:
        raise BackendError(404, "adapter_not_found", f"adapter {name!r} is not loaded")

    async def list_adapters(self) -> AdapterList:
        return AdapterList(qid="", policy=dict(self.policy))

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        self.controls.append(("reset_prefix_cache", None))
        return PrefixCacheReset(qid="", dropped=2)

    async def update_weights(self, request: WeightsUpdate) -> WeightsUpdated:
        self.controls.append(("update_weights", request.path))
        if not request.path.startswith("/ckpt"):
            raise BackendError(404, "weights_not_found", f"weight directory {request.path!r} does not exist")
        self.policy[""] = request.version or self.policy.get("", 0) + 1
        return WeightsUpdated(qid="", version=self.policy[""], tensors=3, load_ms=1.0)

    def training_status(self) -> dict[str, Any]:
        return {"object": "training.status", "active": False, "trainers": []}

    def health(self) -> dict[str, Any]:
        return {"status": self.status, "in_flight": 0}
