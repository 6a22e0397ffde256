"""The control routes RL frameworks call on a vLLM (or SGLang) server, on parallm's engine.

vLLM 0.31 (`VLLM_SERVER_DEV_MODE=1`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), as TRL >= 1.11,
prime-rl 0.8, verifiers and SkyRL call them:
- POST /pause?mode=abort|keep (query; default abort, as vLLM) -> {"status": "paused"};
  POST /resume -> {"status": "resumed"}; GET /is_paused -> {"is_paused": bool}
- GET /server_info -> {"vllm_config": {model_config, lora_config, parallel_config,
  weight_transfer_config: null}}: TRL reads these to choose its sync path (null = no NCCL engine,
  so TRL's GRPO server mode stops with its own message; lora_config set, so AsyncGRPO syncs LoRA)
- GET /get_world_size -> {"world_size": 1}
- POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace} -> text "Success: ..." (vLLM);
  POST /load_lora_adapter (prime-rl) and /skyrl/v1/load_lora_adapter (SkyRL) reload the same name
  in place -> {"status": "ok"}; POST /v1/unload_lora_adapter {lora_name}
- full-weight updates from a checkpoint directory (parallm/engine/weights.py): prime-rl's
  POST /update_weights {weight_dir} -> {"status": "ok"}; SGLang's POST /update_weights_from_disk
  {model_path, weight_version?, abort_all_requests?} -> {success, message, num_paused_requests};
  parallm's POST /v1/weights {path, version?} -> {version, tensors, load_ms}
- POST /reset_prefix_cache (vLLM; TRL's trailing-slash one too) -> {"success": true, ...}; SGLang's
  GET|POST /flush_cache -> text: the free prefix-cache blocks are forgotten (held ones stay)
- SGLang's GET /health_generate (one token generated end to end; 503 when it cannot), GET /model_info
  (and /get_model_info) with `weight_version`, the base model's policy version
- SGLang's POST /pause_generation {mode}, /continue_generation; vLLM's POST /abort_requests
  {request_ids} and SGLang's /abort_request {rid, abort_all}
- POST /v1/chat/completions/tokens (prime-rl <= 0.5, verifiers <= 0.3.1): a chat body plus the prompt's
  token ids in `tokens` (registered by app.py on the generation routes)
- NCCL weight transfer (/init_weight_transfer_engine, /start_weight_update, /update_weights with
  update_info, /finish_weight_update; TRL <= 1.10's /init_communicator/, /update_named_param/,
  /close_communicator/) -> 501 naming what parallm offers instead (adapter and weight publishing).
A loaded adapter is a new policy version of its name in parallm's registry: `load_inplace` (or the
prime-rl/SkyRL routes) adds the next version, and sequences move to it at a step boundary.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from parallm.api.backend import Backend, BackendError
from parallm.api.errors import APIError, invalid
from parallm.api.http import json_response, read_body
from parallm.config import ServerConfig
from parallm.api.schemas import ChatCompletionRequest, Count, Int64
from parallm.api.translate import Plan, chat_plan
from parallm.api.validate import Limits, decode
from parallm.protocol import (AdapterPublish, RequestSpec, SamplingParams, TextSubmit, WeightsUpdate, WeightsUpdated,
                              pack_ids)

PAUSE_MODES = ("abort", "keep")
MAX_LORA_RANK = 1024
NO_NCCL = ("{route} is vLLM's NCCL weight transfer, which needs CUDA on both sides; parallm runs on Apple "
           "silicon. Update the policy with parallm's adapter publishing instead: POST /v1/load_lora_adapter "
           "{{lora_name, lora_path}} (or /v1/adapters); full weights from a checkpoint directory: POST "
           "/update_weights {{weight_dir}} or /update_weights_from_disk {{model_path}}; or a trainer's "
           "AdapterPublish / WeightsUpdate over ZeroMQ (docs/rl.md, docs/training.md).")
NCCL_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
               "/init_communicator/", "/update_named_param/", "/close_communicator/")


class UpdateWeights(msgspec.Struct, kw_only=True):
    """prime-rl's /update_weights {weight_dir} (TRL's NCCL one sends update_info instead)."""

    weight_dir: str | None = None
    update_info: Any = None


class UpdateFromDisk(msgspec.Struct, kw_only=True):
    """SGLang's /update_weights_from_disk (io_struct.UpdateWeightFromDiskReqInput)."""

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class WeightsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """parallm's POST /v1/weights."""

    path: str
    version: Count = 0


class LoadLora(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLora(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: Int64 | None = None


def _body(raw: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise invalid(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None


class VllmAdmin:
    def __init__(self, backend: Backend, server: ServerConfig) -> None:
        self.backend = backend
        self.limit = server.max_body_bytes
        self.max_logprobs = server.max_logprobs
        self.paused = False

    # ------------------------------------------------------------------ pause / resume
    async def pause(self, request: Request) -> Response:
        await read_body(request, self.limit)
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise invalid(f"mode must be abort or keep (got {mode!r}); parallm does not drain ('wait').", "mode")
        mode_: Literal["keep", "abort"] = "keep" if mode == "keep" else "abort"
        state = await self.backend.pause(mode_)
        self.paused = state.paused
        return json_response({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        await read_body(request, self.limit)
        state = await self.backend.resume()
        self.paused = state.paused
        return json_response({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        return json_response({"is_paused": self.paused})

    async def pause_generation(self, request: Request) -> Response:
        """SGLang's POST /pause_generation {mode: abort|retract|in_place} (default abort)."""
        body = _body(await read_body(request, self.limit), dict)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise invalid(f"mode must be abort, retract or in_place (got {mode!r})", "mode")
        state = await self.backend.pause("abort" if mode == "abort" else "keep")
        self.paused = state.paused
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        await read_body(request, self.limit)
        state = await self.backend.resume()
        self.paused = state.paused
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_requests(self, request: Request) -> Response:
        """vLLM's POST /abort_requests {request_ids} (none: all) and SGLang's POST /abort_request
        {rid, abort_all}; ids are the engine request ids (a /generate request's are its client-visible
        id through /v1/abort)."""
        body = _body(await read_body(request, self.limit), dict)
        ids = body.get("request_ids") or ([body["rid"]] if body.get("rid") else [])
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise invalid("request_ids must be a list of strings.", "request_ids")
        every = not ids or bool(body.get("abort_all"))
        await self.backend.abort([] if every else ids, all=every)
        return json_response({"status": "aborted", "aborted": len(ids), "all": every})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's POST /reset_prefix_cache -> {"success": true}; SGLang's GET|POST /flush_cache -> text."""
        await read_body(request, self.limit)
        done = await self.backend.reset_prefix_cache()
        if request.url.path == "/flush_cache":
            return PlainTextResponse(f"Cache flushed.\n{done.dropped} cached blocks dropped; {done.held} held by "
                                     "running requests kept.\n")
        return json_response({"success": True, "dropped": done.dropped, "held": done.held})

    async def health_generate(self, request: Request) -> Response:
        """SGLang's GET /health_generate (slime polls it until 200): one token generated end to end;
        503 when the pipeline cannot (starting, a stage down)."""
        submit = TextSubmit(rid=f"health-{uuid.uuid4().hex}", reply_to=b"", prompt_ids=pack_ids([0]),
                            spec=RequestSpec(params=SamplingParams(max_tokens=1, temperature=0.0)))
        try:
            outputs = self.backend.generate(submit)
            try:
                async for out in outputs:
                    if out.finish_reason == "error":
                        raise BackendError(503, "unhealthy", "the engine failed to generate")
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]
        except BackendError as exc:
            raise APIError(503, f"the server cannot generate: {exc.message}", code="unhealthy") from None
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        """SGLang's GET /model_info (and /get_model_info)."""
        version = (await self.backend.list_adapters()).policy.get("", 0)
        return json_response({"model_path": self.backend.model_name, "served_model_name": self.backend.model_name,
                              "tokenizer_path": self.backend.model_name, "is_generation": True,
                              "preferred_sampling_params": None, "weight_version": str(version)})

    # ------------------------------------------------------------------ server description
    async def server_info(self, request: Request) -> Response:
        adapters = await self.backend.list_adapters()
        return json_response({"vllm_config": {
            "model_config": {"model": self.backend.model_name, "served_model_name": self.backend.model_name,
                             "max_model_len": int(self.backend.max_model_len or 0), "dtype": "auto",
                             "max_logprobs": self.max_logprobs},
            # parallm takes adapters of any rank and keeps every loaded one until it is unloaded
            "lora_config": {"max_lora_rank": MAX_LORA_RANK, "max_loras": max(64, len(adapters.adapters) + 2)},
            "parallel_config": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1},
            "weight_transfer_config": None},
            "server": "parallm"})

    async def world_size(self, request: Request) -> Response:
        return json_response({"world_size": 1})

    # ------------------------------------------------------------------ LoRA
    async def _load(self, name: str, path: str, *, inplace: bool) -> None:
        if not name or not path:
            raise invalid("Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path")
        if name == self.backend.model_name:
            raise invalid(f"The lora adapter name {name!r} is the served model's name.", "lora_name")
        if not inplace:
            listed = await self.backend.list_adapters()
            if any(a.name == name for a in listed.adapters):
                raise invalid(f"The lora adapter {name!r} has already been loaded (load_inplace: true reloads it).",
                              "lora_name")
        await self.backend.load_adapter(AdapterPublish(qid="", reply_to=b"", name=name, path=path))

    async def load_lora(self, request: Request) -> Response:
        req = _body(await read_body(request, self.limit), LoadLora)
        await self._load(req.lora_name, req.lora_path, inplace=req.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def load_lora_inplace(self, request: Request) -> Response:
        """prime-rl's /load_lora_adapter and SkyRL's /skyrl/v1/load_lora_adapter: the same name reloaded."""
        req = _body(await read_body(request, self.limit), LoadLora)
        await self._load(req.lora_name, req.lora_path, inplace=True)
        return json_response({"status": "ok"})

    async def unload_lora(self, request: Request) -> Response:
        req = _body(await read_body(request, self.limit), UnloadLora)
        if not req.lora_name:
            raise invalid("'lora_name' must be provided.", "lora_name")
        await self.backend.unload_adapter(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # ------------------------------------------------------------------ full-weight updates
    async def _update(self, path: str, version: int = 0) -> WeightsUpdated:
        if not path:
            raise invalid("Give the directory of the new weights (safetensors files).", "weight_dir")
        return await self.backend.update_weights(WeightsUpdate(qid="", reply_to=b"", path=path, version=version))

    async def update_weights(self, request: Request) -> Response:
        req = _body(await read_body(request, self.limit), UpdateWeights)
        if req.update_info is not None and req.weight_dir is None:
            raise APIError(501, NO_NCCL.format(route="/update_weights with update_info"), code="not_implemented")
        await self._update(req.weight_dir or "")
        return json_response({"status": "ok"})

    async def update_from_disk(self, request: Request) -> Response:
        req = _body(await read_body(request, self.limit), UpdateFromDisk)
        version = int(req.weight_version) if req.weight_version and req.weight_version.isdigit() else 0
        if req.abort_all_requests:
            await self.backend.pause("abort")
        try:
            done = await self._update(req.model_path, version)
        except (APIError, BackendError) as exc:
            message = exc.message
            return json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)
        finally:
            if req.abort_all_requests:
                await self.backend.resume()
        return json_response({"success": True, "num_paused_requests": 0,
                              "message": f"Succeeded to update model weights (version {done.version})."})

    async def weights(self, request: Request) -> Response:
        req = _body(await read_body(request, self.limit), WeightsRequest)
        done = await self._update(req.path, req.version)
        return json_response({"object": "weights", "version": done.version, "tensors": done.tensors,
                              "load_ms": done.load_ms})

    # ------------------------------------------------------------------ NCCL weight transfer
    def no_nccl(self, route: str):
        async def answer(request: Request) -> Response:
            await read_body(request, self.limit)
            raise APIError(501, NO_NCCL.format(route=route), code="not_implemented")
        return answer


class ChatTokens(msgspec.Struct, kw_only=True):
    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]


def chat_tokens_plan(body: bytes, limits: Limits) -> Plan:
    """POST /v1/chat/completions/tokens (prime-rl <= 0.5's server, verifiers <= 0.3.1's token client): a
    chat completion body plus `tokens`, the prompt's ids, which are used as the prompt instead of
    rendering `messages` (they are checked as usual but not tokenized)."""
    plan = chat_plan(decode(body, ChatCompletionRequest), limits)
    try:
        tokens = msgspec.json.decode(body, type=ChatTokens).tokens
    except msgspec.ValidationError as exc:
        raise invalid(f"tokens: {exc}", "tokens") from None
    if not tokens:
        raise invalid("tokens must be a non-empty list of the prompt's token ids.", "tokens")
    plan.submits = [msgspec.structs.replace(s, messages=None, prompt_ids=pack_ids(tokens)) for s in plan.submits]
    return plan


def routes(backend: Backend, server: ServerConfig, wrap: Any) -> list[Route]:
    a = VllmAdmin(backend, server)
    return [
        Route("/pause", wrap(a.pause), methods=["POST"]),
        Route("/resume", wrap(a.resume), methods=["POST"]),
        Route("/is_paused", wrap(a.is_paused), methods=["GET"]),
        Route("/server_info", wrap(a.server_info), methods=["GET"]),
        Route("/get_world_size", wrap(a.world_size), methods=["GET"]),
        Route("/get_world_size/", wrap(a.world_size), methods=["GET"]),
        Route("/v1/load_lora_adapter", wrap(a.load_lora), methods=["POST"]),
        Route("/v1/unload_lora_adapter", wrap(a.unload_lora), methods=["POST"]),
        Route("/load_lora_adapter", wrap(a.load_lora_inplace), methods=["POST"]),
        Route("/skyrl/v1/load_lora_adapter", wrap(a.load_lora_inplace), methods=["POST"]),
        Route("/pause_generation", wrap(a.pause_generation), methods=["POST"]),
        Route("/continue_generation", wrap(a.continue_generation), methods=["POST"]),
        Route("/abort_requests", wrap(a.abort_requests), methods=["POST"]),
        Route("/abort_request", wrap(a.abort_requests), methods=["POST"]),
        Route("/health_generate", wrap(a.health_generate), methods=["GET"]),
        Route("/model_info", wrap(a.model_info), methods=["GET"]),
        Route("/get_model_info", wrap(a.model_info), methods=["GET"]),
        Route("/reset_prefix_cache", wrap(a.reset_prefix_cache), methods=["POST"]),
        Route("/reset_prefix_cache/", wrap(a.reset_prefix_cache), methods=["POST"]),
        Route("/flush_cache", wrap(a.reset_prefix_cache), methods=["GET", "POST"]),
        Route("/update_weights", wrap(a.update_weights), methods=["POST"]),
        Route("/update_weights_from_disk", wrap(a.update_from_disk), methods=["POST"]),
        Route("/v1/weights", wrap(a.weights), methods=["POST"]),
        *[Route(path, wrap(a.no_nccl(path)), methods=["POST"]) for path in NCCL_ROUTES],
    ]
