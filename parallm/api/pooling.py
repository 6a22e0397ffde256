"""The pooling routes: OpenAI's POST /v1/embeddings, /v1/classifications and vLLM's /classify, /v1/rewards
and vLLM's /pooling. Each input becomes one TextSubmit whose RequestSpec.pooling names the pooling model,
so it travels the generation pipeline (admission, the tokenizer stage with the model's own tokenizer,
the engine's batched pooling passes, the detokenizer's routing) and comes back as an Output whose
`pooled` holds the vector."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api.backend import Backend, BackendError
from parallm.api.errors import APIError, invalid, model_not_found
from parallm.api.http import REQUEST_ID, ClientGone, DisconnectWatch, json_response, read_body
from parallm.api.merge import Deadlines, merged
from parallm.api.pooling_schemas import (ClassificationData, ClassificationRequest, ClassificationResponse,
                                         Embedding, EmbeddingRequest, EmbeddingResponse, PoolingData,
                                         PoolingRequest, PoolingResponse, PoolingUsage, Reward, RewardRequest,
                                         RewardResponse)
from parallm.api.translate import message_dict
from parallm.api.validate import decode
from parallm.config import ServerConfig
from parallm.pooling.spec import PoolingInfo
from parallm.protocol import PoolingSpec, RequestSpec, SamplingParams, TextSubmit, pack_ids

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request


def inputs(value: Any, param: str = "input") -> list[tuple[str, Any]]:
    """OpenAI's `input` as ('prompt', text) or ('ids', token ids) items: a string, strings, token ids,
    or lists of token ids, never mixed."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [list(value)]
    elif value and (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
        items = list(value)
    else:
        raise invalid(f"'{param}' must be a string, a list of strings, a list of token ids or a list of lists of "
                      "token ids (not mixed, not empty)", param)
    if len(items) > MAX_INPUTS:
        raise invalid(f"'{param}' has {len(items)} inputs; at most {MAX_INPUTS} are allowed", param)
    out: list[tuple[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise invalid(f"'{param}' cannot contain an empty string", param)
            out.append(("prompt", item))
        else:
            if not item or any(not isinstance(t, int) or t < 0 for t in item):
                raise invalid(f"'{param}': a list of token ids must be non-empty non-negative integers", param)
            out.append(("ids", item))
    return out


def conversations(value: list[Any]) -> list[tuple[str, Any]]:
    """`messages`: one conversation or a list of them, as ('messages', [message dicts]) items."""
    if all(isinstance(v, list) for v in value):
        convs = value
    elif not any(isinstance(v, list) for v in value):
        convs = [value]
    else:
        raise invalid("'messages' must be one conversation (a list of messages) or a list of conversations", "messages")
    if len(convs) > MAX_INPUTS:
        raise invalid(f"'messages' has {len(convs)} conversations; at most {MAX_INPUTS} are allowed", "messages")
    return [("messages", [message_dict(m) for m in conv]) for conv in convs]


def text_or_chat(input_: Any, messages: Any) -> list[tuple[str, Any]]:
    if (input_ is None) == (messages is None):
        raise invalid("give exactly one of 'input' or 'messages'", "input")
    return inputs(input_) if messages is None else conversations(messages)


def encode_vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


class PoolingRoutes:
    def __init__(self, backend: Backend, server: ServerConfig, gate: Any) -> None:
        self.backend = backend
        self.server = server
        self.gate = gate

    def model(self, name: str | None, tasks: tuple[str, ...]) -> PoolingInfo:
        """The pooling model a request names (or the only one served for its task when it names none)."""
        served = self.backend.pooling_models
        if name is None:
            fitting = [info for info in served.values() if info.task in tasks]
            if len(fitting) != 1:
                raise invalid(f"'model' is required: {len(fitting)} served pooling models do {' or '.join(tasks)}",
                              "model")
            return fitting[0]
        info = served.get(name)
        if info is None:
            raise model_not_found(name)
        if info.task not in tasks:
            raise invalid(f"model '{name}' is a {info.task} model; this route needs a {' or '.join(tasks)} model",
                          "model", code="model_task_mismatch")
        return info

    @staticmethod
    def dimensions(info: PoolingInfo, dims: int | None) -> int:
        if dims is None:
            return 0
        if info.matryoshka is None:
            raise invalid(f"model '{info.name}' does not support 'dimensions' (it declares no Matryoshka "
                          "dimensions)", "dimensions")
        if not info.allows_dimensions(dims):
            allowed = f"one of {list(info.matryoshka)}" if info.matryoshka else f"between 1 and {info.dims}"
            raise invalid(f"'dimensions' must be {allowed} for model '{info.name}'", "dimensions")
        return dims

    async def run(self, request: Request, rid: str, info: PoolingInfo, items: list[tuple[str, Any]], *,
                  dims: int = 0, priority: int = 0) -> tuple[list[np.ndarray], int]:
        """Every item's vector (in order) and the prompt tokens they took, through the pipeline."""
        spec_of = lambda: RequestSpec(params=SamplingParams(max_tokens=0), priority=priority,  # noqa: E731
                                      pooling=PoolingSpec(model=info.name, task=info.task, dimensions=dims))
        submits = []
        for i, (kind, value) in enumerate(items):
            sub_rid = rid if len(items) == 1 else f"{rid}-{i}"
            if kind == "prompt":
                submits.append(TextSubmit(rid=sub_rid, reply_to=b"", spec=spec_of(), prompt=value))
            elif kind == "ids":
                submits.append(TextSubmit(rid=sub_rid, reply_to=b"", spec=spec_of(), prompt_ids=pack_ids(value)))
            else:
                submits.append(TextSubmit(rid=sub_rid, reply_to=b"", spec=spec_of(), messages=value,
                                          add_generation_prompt=False, add_special_tokens=False))
        request.scope[REQUEST_ID] = rid
        self.gate.enter()
        watch = DisconnectWatch(request.receive)
        vectors: list[np.ndarray | None] = [None] * len(items)
        tokens = 0
        outputs = merged(self.backend, submits, Deadlines(0.0, self.server.request_timeout_s))
        try:
            async def collect() -> None:
                nonlocal tokens
                async for index, out in outputs:
                    if out.pooled:
                        vectors[index] = np.frombuffer(out.pooled, dtype="<f4")
                        tokens += out.usage.prompt_tokens if out.usage else 0
                    elif out.finish_reason is not None:
                        raise APIError(503, "the pooling request was aborted before it was done; retry it",
                                       code="aborted", headers={"Retry-After": "1"})

            await watch.race(collect())
        except BackendError as exc:  # the tokenizer stage names the prompt by generation's name
            if exc.param == "prompt":
                exc.param = "input"
            raise
        finally:
            await outputs.aclose()
            watch.stop()
            self.gate.leave()
        return [v for v in vectors if v is not None], tokens

    # ------------------------------------------------------------------ routes
    async def embeddings(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), EmbeddingRequest)
        info = self.model(req.model, ("embed",))
        dims = self.dimensions(info, req.dimensions)
        vectors, tokens = await self.run(request, "embd-" + uuid.uuid4().hex, info, inputs(req.input),
                                         dims=dims, priority=req.priority)
        return json_response(EmbeddingResponse(
            data=[Embedding(index=i, embedding=encode_vector(v, req.encoding_format)) for i, v in enumerate(vectors)],
            model=info.name, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def classify(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), ClassificationRequest)
        info = self.model(req.model, ("classify",))
        rid = "classify-" + uuid.uuid4().hex
        vectors, tokens = await self.run(request, rid, info, inputs(req.input), priority=req.priority)
        data = []
        for i, logits in enumerate(vectors):
            probs = np.exp(logits - logits.max())
            probs = probs / probs.sum()
            data.append(ClassificationData(index=i, label=info.labels[int(probs.argmax())], probs=probs.tolist(),
                                           num_classes=len(probs)))
        return json_response(ClassificationResponse(id=rid, created=int(time.time()), model=info.name, data=data,
                                                    usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def rewards(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), RewardRequest)
        info = self.model(req.model, ("reward",))
        rid = "reward-" + uuid.uuid4().hex
        vectors, tokens = await self.run(request, rid, info, text_or_chat(req.input, req.messages),
                                         priority=req.priority)
        return json_response(RewardResponse(id=rid, created=int(time.time()), model=info.name,
                                            data=[Reward(index=i, reward=float(v[0])) for i, v in enumerate(vectors)],
                                            usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def pooling(self, request: Request) -> Response:
        """vLLM's /pooling: the model's raw output per input (reward: [score]; embed: the vector;
        classify: the class probabilities)."""
        req = decode(await read_body(request, self.server.max_body_bytes), PoolingRequest)
        info = self.model(req.model, (req.task,) if req.task else ("embed", "reward", "classify"))
        dims = self.dimensions(info, req.dimensions) if info.task == "embed" else 0
        if req.dimensions is not None and info.task != "embed":
            raise invalid("'dimensions' applies to embedding models only", "dimensions")
        rid = "pool-" + uuid.uuid4().hex
        vectors, tokens = await self.run(request, rid, info, text_or_chat(req.input, req.messages), dims=dims,
                                         priority=req.priority)
        if info.task == "classify":
            vectors = [np.exp(v - v.max()) / np.exp(v - v.max()).sum() for v in vectors]
        return json_response(PoolingResponse(
            id=rid, created=int(time.time()), model=info.name,
            data=[PoolingData(index=i, data=encode_vector(v, req.encoding_format)) for i, v in enumerate(vectors)],
            usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))


def pooling_routes(backend: Backend, server: ServerConfig, gate: Any, endpoint: Callable[[Any], Any]) -> list[Route]:
    """The pooling routes, each handler wrapped by app.endpoint (OpenAI error bodies)."""
    p = PoolingRoutes(backend, server, gate)

    def gone_ok(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientGone:  # the client left: what it asked for was aborted
                return Response(status_code=499)
        return endpoint(run)

    return [
        Route("/v1/embeddings", gone_ok(p.embeddings), methods=["POST"]),
        Route("/v1/classifications", gone_ok(p.classify), methods=["POST"]),
        Route("/classify", gone_ok(p.classify), methods=["POST"]),
        Route("/v1/rewards", gone_ok(p.rewards), methods=["POST"]),
        Route("/pooling", gone_ok(p.pooling), methods=["POST"]),
    ]
