"""Token-level HTTP routes for RL trainers (docs/rl.md):

- POST /generate (and /generate/): vLLM's, TRL's, SGLang's and the MLX RL Inference Server's shapes on one route;
- POST /inference/v1/generate: vLLM's token-in/token-out route (prime-rl, verifiers/renderers, SkyRL);
- GET /v1/policy: the current policy version of every adapter (the engine's "policy" query);
- GET /v1/training/status: what each trainer (parallm-train) last reported;
- GET /v1/spec_decode/metrics: speculative decoding's counters (the engine stats' `spec`);
- POST /v1/pause {mode: keep|abort}, POST /v1/resume, POST /v1/abort {request_ids | all}: protocol
  Pause / Resume / Abort sent to the engine through the backend.

A /generate request is abortable by its client-visible id: the MLX RL `request_id`, else the
`X-Request-Id` header, else the generated `gen-...` id; /v1/abort maps that id to the engine
request ids it stands for. Any other id (a `cmpl-...`, a raw client's rid) is passed through as is.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from parallm.api.backend import Backend, BackendError
from parallm.api.errors import invalid
from parallm.api.generation import backend_limits
from parallm.api.http import REQUEST_ID, ClientGone, DisconnectWatch, json_response, read_body
from parallm.api.merge import Deadlines, merged
from parallm.api.rl_native import render_sglang, render_tito, sglang_request, tito_request
from parallm.api.rl_plan import Job, build, parse
from parallm.api.rl_render import Gathered, render
from parallm.api.rl_schemas import AbortRequest, PauseRequest
from parallm.api.rl_shape import shape_of
from parallm.api.validate import Limits, decode
from parallm.config import ServerConfig
from parallm.protocol import SpecStats

log = logging.getLogger("parallm.api")


class RLRoutes:
    def __init__(self, backend: Backend, server: ServerConfig, gate: Any) -> None:
        self.backend = backend
        self.server = server
        self.gate = gate
        self.live: dict[str, list[str]] = {}   # client-visible id -> engine request ids in flight

    def limits(self) -> Limits:
        return backend_limits(self.backend, self.server)

    # ------------------------------------------------------------------ /generate
    async def generate(self, request: Request) -> Response:
        body = await read_body(request, self.server.max_body_bytes)
        raw = decode(body, Any)
        if not isinstance(raw, dict):
            raise invalid("The request body must be a JSON object.", code="invalid_json")
        shape = shape_of(raw)
        if shape == "sglang":
            sglang, req, names = sglang_request(raw)
            job = build("vllm", req, self.limits(), answer="sglang")
            job.prompt_params, job.image_params = names.prompts, names.images
            if sglang.return_text_in_logprobs:
                job.text_in_logprobs = True
                for submit in job.submits:
                    if submit.spec.detok is not None:
                        submit.spec.detok.token_strings = True
            name = str(sglang.rid or request.headers.get("x-request-id") or job.rid)
            gathered = await self._run(job, name, request)
            return await _respond(job, lambda: json_response(render_sglang(gathered)))
        job = build(shape, parse(shape, raw), self.limits())
        job.trl_nested = shape == "trl" and ("logprobs" in raw or "logprobs" in (raw.get("generation_kwargs") or {}))
        name = str(raw.get("request_id") or request.headers.get("x-request-id") or job.rid)
        gathered = await self._run(job, name, request)
        return await _respond(job, lambda: json_response(render(gathered)))

    async def generate_tokens(self, request: Request) -> Response:
        """vLLM's POST /inference/v1/generate: token ids in, token ids and logprobs out."""
        body = await read_body(request, self.server.max_body_bytes)
        raw = decode(body, Any)
        if not isinstance(raw, dict):
            raise invalid("The request body must be a JSON object.", code="invalid_json")
        tito, req = tito_request(raw, self.backend.model_name)
        job = build("vllm", req, self.limits(), answer="tito")
        job.model = tito.model or self.backend.model_name
        name = str(tito.request_id or request.headers.get("x-request-id") or job.rid)
        gathered = await self._run(job, name, request)
        return await _respond(job, lambda: json_response(render_tito(gathered, tito)))

    async def _run(self, job: Job, name: str, request: Request) -> Any:
        """Run a Job under its client-visible id (abortable through /v1/abort); a 499 if the client left."""
        if name in self.live:
            raise invalid(f"request_id {name!r} is already in flight.", "request_id")
        request.scope[REQUEST_ID] = job.rid
        self.gate.enter()
        self.live[name] = [s.rid for s in job.submits]
        watch = DisconnectWatch(request.receive)
        try:
            return await watch.race(self._gather(job))
        except ClientGone:
            raise ClientDisconnect() from None
        finally:
            watch.stop()
            self.live.pop(name, None)
            self.gate.leave()

    async def _gather(self, job: Job) -> Gathered:
        gathered = Gathered(job)
        outputs = merged(self.backend, job.submits,
                         Deadlines(self.server.first_token_timeout_s, self.server.request_timeout_s))
        try:
            async for i, out in outputs:
                if out.prompt_logprobs:  # off the event loop (sse.added says why)
                    await asyncio.to_thread(gathered.add, i, out, self.backend.last_batch_size)
                else:
                    gathered.add(i, out, self.backend.last_batch_size)
        except BackendError as exc:  # the tokenizer stage's errors name `prompt` and `images[k]` of one prompt
            raise job.renamed(exc) from None
        finally:
            await outputs.aclose()
        return gathered

    # ------------------------------------------------------------------ policy, pause, resume, abort
    async def policy(self, request: Request) -> Response:
        adapters = await self.backend.list_adapters()
        versions = {"": 0, **adapters.policy}
        return json_response({"object": "policy", "versions": versions, "current_policy_version": versions.get(adapters.default_adapter, 0),
                              "default_adapter": adapters.default_adapter})

    async def training_status(self, request: Request) -> Response:
        """Every trainer that reported to this server: its state, step, version, latest metrics; and
        `weights`, the engine's full-weight updates: the base version, a chunked update being received,
        and why the last one was refused (a trainer publishing over PUB gets no other answer)."""
        body = dict(self.backend.training_status())
        try:
            stats = await self.backend.engine_stats()
        except BackendError:
            body["weights"] = None                    # the engine did not answer: no news of it
        else:
            body["weights"] = {"version": stats.weights_version, "updates": stats.weights_updates,
                               **msgspec.structs.asdict(stats.weights)}
        return json_response(body)

    async def spec_decode_metrics(self, request: Request) -> Response:
        """Speculative decoding's counters (engine stats `spec`): the mode, acceptance rate, mean accepted
        tokens, k distribution; {"mode": "none"} when it is off."""
        stats = await self.backend.engine_stats()
        spec = stats.spec if stats.spec is not None else SpecStats()
        return json_response({"object": "spec_decode_metrics", **msgspec.structs.asdict(spec)})

    async def pause(self, request: Request) -> Response:
        req = _optional_body(await read_body(request, self.server.max_body_bytes), PauseRequest)
        state = await self.backend.pause(req.mode)
        return json_response({"paused": state.paused, "mode": state.mode})

    async def resume(self, request: Request) -> Response:
        await read_body(request, self.server.max_body_bytes)
        state = await self.backend.resume()
        return json_response({"paused": state.paused, "moved_to_latest": state.moved_to_latest})

    async def abort(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), AbortRequest)
        if not req.all and not req.request_ids:
            raise invalid("Give request_ids (a non-empty list) or all: true.", "request_ids")
        rids = [rid for name in req.request_ids for rid in self.live.get(name, [name])]
        await self.backend.abort(rids, all=req.all)
        return json_response({"aborted": req.request_ids, "all": req.all})


async def _respond(job: Job, build: Callable[[], Response]) -> Response:
    """The response, built on a worker thread when it carries prompt logprobs (TRL asks 100 a position: their
    JSON is Python work that held the ingress's event loop; sse.added)."""
    return await asyncio.to_thread(build) if job.prompt_logprobs is not None else build()


def _optional_body(body: bytes, kind: type) -> Any:
    """An empty body is the defaults of `kind`; anything else is decoded and checked."""
    if not body.strip():
        return kind()
    return decode(body, kind)


def rl_routes(backend: Backend, server: ServerConfig, gate: Any, endpoint: Any) -> list[Route]:
    """The RL routes, each handler wrapped by app.endpoint (OpenAI error bodies)."""
    rl = RLRoutes(backend, server, gate)
    return [
        Route("/generate", endpoint(rl.generate), methods=["POST"]),
        Route("/generate/", endpoint(rl.generate), methods=["POST"]),
        Route("/inference/v1/generate", endpoint(rl.generate_tokens), methods=["POST"]),
        Route("/v1/policy", endpoint(rl.policy), methods=["GET"]),
        Route("/v1/pause", endpoint(rl.pause), methods=["POST"]),
        Route("/v1/resume", endpoint(rl.resume), methods=["POST"]),
        Route("/v1/abort", endpoint(rl.abort), methods=["POST"]),
        Route("/v1/training/status", endpoint(rl.training_status), methods=["GET"]),
        Route("/v1/spec_decode/metrics", endpoint(rl.spec_decode_metrics), methods=["GET"]),
    ]

