"""The policy routes: POST /v1/rl/act, POST /v1/predict, GET /v1/policies.

Tensors travel as nested JSON lists or as {"b64": base64 of packed little-endian bytes, "dtype", "shape"};
a response uses the request's `encoding`. A request is checked against the model's signature in the
policy stage (one place); a bad tensor comes back as a 400 whose `param` names it.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Awaitable, Callable, Literal, Protocol

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from parallm import protocol
from parallm.api import openapi
from parallm.api.errors import APIError, invalid
from parallm.api.http import json_response, read_body
from parallm.api.validate import decode
from parallm.config import ServerConfig
from parallm.metrics import ServerMetrics
from parallm.policies.errors import TensorError
from parallm.policies.tensors import from_json, to_json, unwire, wire
from parallm.streams import ClientError

Encoding = Literal["json", "base64"]
MAX_SEED = (1 << 63) - 1   # JSON schema integers are int64; the raw protocol takes any uint64


class PolicyBackend(Protocol):
    """What the routes need of the policy stage (parallm.policies.client.AsyncPolicyClient)."""

    @property
    def in_flight(self) -> int: ...

    async def act(self, message: protocol.PolicyAct) -> protocol.PolicyActReply: ...

    async def predict(self, message: protocol.Predict) -> protocol.PredictReply: ...

    async def policies(self) -> list[protocol.PolicyInfo]: ...


class ActRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    observations: Any                        # a tensor (the model's only input), or {input name: tensor}
    hidden_states: dict[str, Any] = {}
    episode_ids: list[str] = []
    episode_starts: list[bool] = []
    deterministic: bool = False
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED)] | None = None
    encoding: Encoding = "json"


class PredictRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    inputs: Any                              # {input name: tensor}, or one tensor for a one-input model
    hidden_states: dict[str, Any] = {}
    episode_ids: list[str] = []
    episode_starts: list[bool] = []
    encoding: Encoding = "json"


class ActResponse(Struct, kw_only=True):
    object: str = "rl.act"
    model: str
    actions: Any                             # int64 [B] or float32 [B, dim]: a JSON list or a base64 tensor
    action_log_probs: Any
    value_estimates: Any = None
    new_hidden_states: dict[str, Any] = {}
    version: int = 0


class PredictResponse(Struct, kw_only=True):
    object: str = "predict"
    model: str
    outputs: dict[str, Any]
    new_hidden_states: dict[str, Any] = {}
    version: int = 0


class PolicyCard(Struct, kw_only=True):
    object: str = "policy"
    name: str
    version: int
    action: str = ""
    value: bool = False
    signature: dict[str, Any] = {}


class PolicyListResponse(Struct, kw_only=True):
    object: str = "list"
    data: list[PolicyCard]


openapi.register("post", "/v1/rl/act", "Actions, their log-probs and value estimates of a non-LLM policy",
                 ActRequest, {200: ActResponse})
openapi.register("post", "/v1/predict", "Named outputs of a served network for named input tensors",
                 PredictRequest, {200: PredictResponse})
openapi.register("get", "/v1/policies", "The served policies and their signatures", None, {200: PolicyListResponse})


def _tensors(value: Any, param: str) -> dict[str, protocol.Tensor]:
    """Named wire tensors from a JSON tensor or a map of them; a bare one is named "" (the only input)."""
    try:
        if isinstance(value, dict) and "b64" not in value:
            return {name: wire(from_json(name, v)) for name, v in value.items()}
        return {"": wire(from_json(param, value))}
    except TensorError as exc:
        raise invalid(str(exc), param=exc.tensor, code="invalid_tensor") from None
    except ValueError as exc:  # a dtype that cannot travel
        raise invalid(f"{param}: {exc}", param=param, code="invalid_tensor") from None


def _out(tensors: dict[str, protocol.Tensor], b64: bool) -> dict[str, Any]:
    return {name: to_json(unwire(name, t), b64) for name, t in tensors.items()}


class PolicyRoutes:
    def __init__(self, policies: PolicyBackend, server: ServerConfig, draining: Callable[[], bool],
                 metrics: ServerMetrics) -> None:
        self.policies = policies
        self.server = server
        self.draining = draining
        self.metrics = metrics

    def _admit(self) -> None:
        if self.draining():
            raise APIError(503, "The server is shutting down.", code="shutting_down", headers={"Retry-After": "1"})
        limit = self.server.max_concurrent_requests
        if limit and self.policies.in_flight >= limit:
            raise APIError(429, "Too many policy requests in flight; retry shortly.", code="too_many_requests",
                           headers={"Retry-After": "1"})

    async def _call(self, call: Awaitable[Any], route: str) -> Any:
        start = time.perf_counter()
        try:
            return await call
        except ClientError as exc:
            headers = {"Retry-After": "1"} if exc.retryable else None
            raise APIError(exc.status if exc.status >= 400 else 400, str(exc), param=exc.param, code=exc.code,
                           headers=headers) from None
        finally:
            self.metrics.policy_latency.labels(route).observe(time.perf_counter() - start)

    async def act(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), ActRequest)
        self._admit()
        message = protocol.PolicyAct(qid=_qid(), model=req.model, inputs=_tensors(req.observations, "observations"),
                                     hidden_states=_named(req.hidden_states, "hidden_states"),
                                     episode_ids=req.episode_ids, episode_starts=req.episode_starts,
                                     deterministic=req.deterministic, seed=req.seed)
        reply = await self._call(self.policies.act(message), "act")
        b64 = req.encoding == "base64"
        values = None if reply.value_estimates is None else to_json(unwire("v", reply.value_estimates), b64)
        return json_response(ActResponse(
            model=req.model, actions=to_json(unwire("actions", reply.actions), b64),
            action_log_probs=to_json(unwire("action_log_probs", reply.action_log_probs), b64),
            value_estimates=values, new_hidden_states=_out(reply.new_hidden_states, b64), version=reply.version))

    async def predict(self, request: Request) -> Response:
        req = decode(await read_body(request, self.server.max_body_bytes), PredictRequest)
        self._admit()
        message = protocol.Predict(qid=_qid(), model=req.model, inputs=_tensors(req.inputs, "inputs"),
                                   hidden_states=_named(req.hidden_states, "hidden_states"),
                                   episode_ids=req.episode_ids, episode_starts=req.episode_starts)
        reply = await self._call(self.policies.predict(message), "predict")
        b64 = req.encoding == "base64"
        return json_response(PredictResponse(model=req.model, outputs=_out(reply.outputs, b64),
                                             new_hidden_states=_out(reply.new_hidden_states, b64),
                                             version=reply.version))

    async def list(self, request: Request) -> Response:
        infos = await self._call(self.policies.policies(), "list")
        return json_response(PolicyListResponse(data=[PolicyCard(**msgspec.structs.asdict(p)) for p in infos]))


def _named(value: dict[str, Any], param: str) -> dict[str, protocol.Tensor]:
    tensors = _tensors(value, param) if value else {}
    if "" in tensors:
        raise invalid(f"{param} must map state names to tensors", param=param, code="invalid_tensor")
    return tensors


def _qid() -> str:
    return uuid.uuid4().hex


def policy_routes(policies: PolicyBackend, server: ServerConfig, draining: Callable[[], bool],
                  endpoint: Callable, metrics: ServerMetrics) -> list[Route]:
    r = PolicyRoutes(policies, server, draining, metrics)
    return [Route("/v1/rl/act", endpoint(r.act), methods=["POST"]),
            Route("/v1/predict", endpoint(r.predict), methods=["POST"]),
            Route("/v1/policies", endpoint(r.list), methods=["GET"])]


__all__ = ["ActRequest", "ActResponse", "PolicyBackend", "PredictRequest", "PredictResponse", "policy_routes"]
