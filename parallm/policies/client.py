"""Raw ZeroMQ clients of the policy stage: a DEALER on its ROUTER (`policy` address), one request,
one reply, matched by qid. `PolicyClient` blocks (an environment loop's hot path: no event loop, no
thread hop); `AsyncPolicyClient` is the asyncio face (ingress), a reader task dispatching replies to
futures. Both build their messages and read their replies with the same functions below.

    with PolicyClient("ipc:///tmp/parallm-xyz/policy.sock") as client:
        out = client.act("cartpole", obs, seed=1)          # out.actions, out.action_log_probs, out.version ...
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import zmq
import zmq.asyncio

from .. import protocol
from ..keys import Curve, client_curve
from ..streams import ClientError, error_of
from ..transport import open_socket
from .tensors import unwire, wire

Tensors = np.ndarray | Mapping[str, np.ndarray]


@dataclass
class ActOutput:
    actions: np.ndarray
    action_log_probs: np.ndarray
    value_estimates: np.ndarray | None
    new_hidden_states: dict[str, np.ndarray] = field(default_factory=dict)
    version: int = 0


@dataclass
class PredictOutput:
    outputs: dict[str, np.ndarray]
    new_hidden_states: dict[str, np.ndarray] = field(default_factory=dict)
    version: int = 0


def named(inputs: Tensors) -> dict[str, protocol.Tensor]:
    """Wire tensors of named inputs; a bare array is the policy's only input (name "")."""
    if isinstance(inputs, np.ndarray):
        return {"": wire(inputs)}
    return {name: wire(np.asarray(value)) for name, value in inputs.items()}


def act_message(model: str, observations: Tensors, *, hidden_states: Mapping[str, np.ndarray] | None = None,
                episode_ids: Sequence[str] = (), episode_starts: Sequence[bool] = (), deterministic: bool = False,
                seed: int | None = None, qid: str | None = None) -> protocol.PolicyAct:
    return protocol.PolicyAct(qid=qid or uuid.uuid4().hex, model=model, inputs=named(observations),
                              hidden_states=named(hidden_states or {}), episode_ids=list(episode_ids),
                              episode_starts=list(episode_starts), deterministic=deterministic, seed=seed)


def predict_message(model: str, inputs: Tensors, *, hidden_states: Mapping[str, np.ndarray] | None = None,
                    episode_ids: Sequence[str] = (), episode_starts: Sequence[bool] = (),
                    qid: str | None = None) -> protocol.Predict:
    return protocol.Predict(qid=qid or uuid.uuid4().hex, model=model, inputs=named(inputs),
                            hidden_states=named(hidden_states or {}), episode_ids=list(episode_ids),
                            episode_starts=list(episode_starts))


def act_output(reply: protocol.PolicyActReply) -> ActOutput:
    return ActOutput(unwire("actions", reply.actions), unwire("action_log_probs", reply.action_log_probs),
                     None if reply.value_estimates is None else unwire("value_estimates", reply.value_estimates),
                     {n: unwire(n, t) for n, t in reply.new_hidden_states.items()}, reply.version)


def predict_output(reply: protocol.PredictReply) -> PredictOutput:
    return PredictOutput({n: unwire(n, t) for n, t in reply.outputs.items()},
                         {n: unwire(n, t) for n, t in reply.new_hidden_states.items()}, reply.version)


def _checked(reply: Any, kind: type) -> Any:
    if isinstance(reply, protocol.RequestError):
        raise error_of(reply)
    if not isinstance(reply, kind):
        raise ClientError(f"the policy stage answered {type(reply).__name__} where {kind.__name__} was due",
                          status=502, code="bad_reply")
    return reply


def _curve(server_key: str | None, client_key: str | None) -> Curve | None:
    return client_curve(server_key, client_key) if server_key and client_key else None


class PolicyClient:
    """Blocking client; one request at a time (use one per thread)."""

    def __init__(self, address: str, *, timeout: float = 30.0, server_key: str | None = None,
                 client_key: str | None = None, ctx: zmq.Context | None = None) -> None:
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.timeout_ms = int(timeout * 1000)
        self.sock = open_socket(self.ctx, zmq.DEALER, address, bind=False, curve=_curve(server_key, client_key))
        self._decoder = protocol.Decoder(protocol.PolicyClientInbound)

    def call(self, message: Any) -> Any:
        """Send a request and wait for the reply with its qid (older replies are skipped)."""
        self.sock.send(protocol.encode(message), copy=False)
        while True:
            if not self.sock.poll(self.timeout_ms, zmq.POLLIN):
                raise ClientError(f"no answer from the policy stage within {self.timeout_ms / 1000:g} s",
                                  status=504, code="timeout", retryable=True)
            reply = self._decoder.decode(self.sock.recv(copy=True))
            if getattr(reply, "qid", getattr(reply, "rid", None)) == message.qid:
                return reply

    def act(self, model: str, observations: Tensors, **kwargs: Any) -> ActOutput:
        return act_output(_checked(self.call(act_message(model, observations, **kwargs)), protocol.PolicyActReply))

    def predict(self, model: str, inputs: Tensors, **kwargs: Any) -> PredictOutput:
        return predict_output(_checked(self.call(predict_message(model, inputs, **kwargs)), protocol.PredictReply))

    def policies(self) -> list[protocol.PolicyInfo]:
        return _checked(self.call(protocol.ListPolicies(qid=uuid.uuid4().hex)), protocol.PolicyList).policies

    def stats(self) -> protocol.PolicyStats:
        return _checked(self.call(protocol.GetStats(qid=uuid.uuid4().hex)), protocol.StatsReply).stats

    def close(self) -> None:
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> "PolicyClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncPolicyClient:
    """asyncio client: many requests in flight, each answered by qid. `fail_all` ends every pending
    one with an error (the policy stage went down)."""

    def __init__(self, address: str, *, timeout: float = 30.0, ctx: zmq.Context | None = None,
                 curve: Curve | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.timeout = timeout
        self.sock = zmq.asyncio.Socket.from_socket(open_socket(self.ctx, zmq.DEALER, address, bind=False, curve=curve))
        self._decoder = protocol.Decoder(protocol.PolicyClientInbound)
        self._pending: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def call(self, message: Any) -> Any:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name="policy-client-reader")
        future = asyncio.get_running_loop().create_future()
        self._pending[message.qid] = future
        try:
            await self.sock.send(protocol.encode(message), copy=False)
            return await asyncio.wait_for(future, self.timeout)
        except asyncio.TimeoutError:
            raise ClientError(f"no answer from the policy stage within {self.timeout:g} s", status=504,
                              code="timeout", retryable=True) from None
        finally:
            self._pending.pop(message.qid, None)

    async def _read(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                reply = self._decoder.decode(frame)
            except protocol.ProtocolError:
                continue
            future = self._pending.get(getattr(reply, "qid", getattr(reply, "rid", "")))
            if future is not None and not future.done():
                future.set_result(reply)

    def fail_all(self, error: protocol.RequestError) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_result(error)

    async def act(self, message: protocol.PolicyAct) -> protocol.PolicyActReply:
        return _checked(await self.call(message), protocol.PolicyActReply)

    async def predict(self, message: protocol.Predict) -> protocol.PredictReply:
        return _checked(await self.call(message), protocol.PredictReply)

    async def policies(self) -> list[protocol.PolicyInfo]:
        return _checked(await self.call(protocol.ListPolicies(qid=uuid.uuid4().hex)), protocol.PolicyList).policies

    async def stats(self) -> protocol.PolicyStats:
        return _checked(await self.call(protocol.GetStats(qid=uuid.uuid4().hex)), protocol.StatsReply).stats

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(0)
