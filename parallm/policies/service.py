"""The policy stage's core, without sockets: admit act/predict requests (decode and check their
tensors), batch them (batcher.py), run each batch as one forward, and build every request's reply.
Also applies versioned weight updates between batches and keeps episodes' state (episodes.py).

`submit` answers at once only a request it refuses; `run_due(now)` runs what is ready and returns
(client identity, reply) pairs. The stage calls both from its one loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Union

import numpy as np

from .. import protocol
from .batcher import Batcher
from .episodes import EpisodeStore
from .errors import PolicyLoadError, TensorError
from .policy import Policy
from .rng import MASK64, row_seeds
from .tensors import unwire, wire

log = logging.getLogger("parallm.policies")

Request = Union[protocol.PolicyAct, protocol.Predict]
Outgoing = tuple[bytes, Any]


class Refused(Exception):
    """A request refused before batching: (status, code, param, message)."""

    def __init__(self, status: int, code: str, param: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass(slots=True)
class _Job:
    identity: bytes
    request: Request
    inputs: dict[str, np.ndarray]
    state: dict[str, np.ndarray] | None     # given by the client; None: episodes' or zeros
    rows: int
    seeds: np.ndarray
    act: bool


class PolicyService:
    def __init__(self, policies: Mapping[str, Policy], *, max_batch: int, flush_us: int,
                 episode_ttl_s: float, max_episodes: int, max_queued_rows: int = 65536) -> None:
        self.policies = dict(policies)
        self.max_queued_rows = max_queued_rows
        self.batcher: Batcher[_Job] = Batcher(max_batch, flush_us)
        self.episodes = EpisodeStore(episode_ttl_s, max_episodes)
        self.counts = protocol.PolicyStats()
        self._entropy = np.random.default_rng()

    # ------------------------------------------------------------------ requests
    def submit(self, identity: bytes, request: Request, now: float) -> list[Outgoing]:
        """Queue a request; [] when queued, else its refusal."""
        try:
            job = self._admit(identity, request)
        except TensorError as exc:
            return [self._refuse(identity, request.qid, 400, "invalid_tensor", exc.tensor, str(exc))]
        except Refused as exc:
            return [self._refuse(identity, request.qid, exc.status, exc.code, exc.param, str(exc))]
        if self.batcher.rows + job.rows > self.max_queued_rows:
            return [self._refuse(identity, request.qid, 503, "overloaded", None,
                                 f"{self.batcher.rows} rows wait for a forward already; retry shortly")]
        episodes = tuple(request.episode_ids) if job.state is None else ()
        self.batcher.add((request.model, job.act), job, job.rows, now, episodes)
        return []

    def _refuse(self, identity: bytes, qid: str, status: int, code: str, param: str | None, message: str) -> Outgoing:
        self.counts.requests += 1
        self.counts.rejected += 1
        return identity, protocol.RequestError(rid=qid, status=status, code=code, param=param, message=message,
                                               retryable=status == 503)

    def _admit(self, identity: bytes, request: Request) -> _Job:
        policy = self.policies.get(request.model)
        if policy is None:
            raise Refused(404, "model_not_found", "model", f"no policy named {request.model!r} is served "
                                                           f"(served: {sorted(self.policies)})")
        act = isinstance(request, protocol.PolicyAct)
        if act and policy.spec.distribution is None:
            raise Refused(400, "invalid_request_error", "model",
                          f"policy {request.model!r} has no action head: use /v1/predict")
        sig = policy.signature
        given = dict(request.inputs)
        if "" in given:   # a bare tensor: the policy's only input
            if len(given) > 1 or len(sig.inputs) != 1:
                raise TensorError("observations", f"this model takes named inputs {sorted(sig.inputs)}")
            given = {next(iter(sig.inputs)): given[""]}
        inputs, rows = sig.check_inputs({name: unwire(name, t) for name, t in given.items()})
        state = None
        if request.hidden_states and request.episode_ids:
            raise Refused(400, "invalid_request_error", "hidden_states",
                          "give hidden_states or episode_ids, not both")
        if request.hidden_states:
            state = sig.check_state({name: unwire(name, t) for name, t in request.hidden_states.items()}, rows)
        elif request.episode_ids:
            if len(request.episode_ids) != rows or len(set(request.episode_ids)) != rows:
                raise Refused(400, "invalid_request_error", "episode_ids",
                              f"episode_ids must name {rows} distinct episodes, one per row")
            if request.episode_starts and len(request.episode_starts) != rows:
                raise Refused(400, "invalid_request_error", "episode_starts",
                              f"episode_starts must have {rows} entries, one per row")
        elif sig.state:
            state = sig.zero_state(rows)
        seed = getattr(request, "seed", None)
        if seed is None:
            seed = int(self._entropy.integers(0, 1 << 63))
        return _Job(identity, request, inputs, state, rows, row_seeds(seed & MASK64, rows), act)

    # ------------------------------------------------------------------ batches
    def next_deadline(self) -> float | None:
        return self.batcher.next_deadline()

    def run_due(self, now: float, flush_all: bool = False) -> list[Outgoing]:
        """Run every batch ready at `now`; the replies to send."""
        out: list[Outgoing] = []
        for (model, act), jobs in self.batcher.due(now, flush_all):   # in order: a batch sees the state the last left
            out += self._run(self.policies[model], act, jobs, now)
        self.episodes.expire(now)
        return out

    def _run(self, policy: Policy, act: bool, jobs: list[_Job], now: float) -> list[Outgoing]:
        sig = policy.signature
        zeros = {n: z[0] for n, z in sig.zero_state(1).items()}
        states = [job.state if job.state is not None else
                  self.episodes.gather(policy.name, list(job.request.episode_ids), list(job.request.episode_starts), zeros)
                  for job in jobs]
        inputs = {n: _cat([job.inputs[n] for job in jobs]) for n in sig.inputs}
        state = {n: _cat([s[n] for s in states]) for n in sig.state}
        self.counts.requests += len(jobs)
        self.counts.batches += 1
        rows = sum(job.rows for job in jobs)
        self.counts.rows += rows
        self.counts.max_batch_rows = max(self.counts.max_batch_rows, rows)
        try:
            if act:
                deterministic = np.concatenate([np.full(job.rows, job.request.deterministic) for job in jobs])
                result = policy.act(inputs, state, np.concatenate([job.seeds for job in jobs]), deterministic)
                outputs, new_state = {}, result.new_state
            else:
                outputs, new_state = policy.forward(inputs, state)
        except Exception:  # noqa: BLE001 - a failing forward fails its batch, not the stage
            log.exception("policy %s: a forward of %d rows failed", policy.name, rows)
            self.counts.failed += len(jobs)
            return [(job.identity, protocol.RequestError(rid=job.request.qid, status=500, code="internal_error",
                                                         message="the policy's forward failed; the server logged why"))
                    for job in jobs]
        replies: list[Outgoing] = []
        start = 0
        for job in jobs:
            part = slice(start, start + job.rows)
            start += job.rows
            hidden = {n: wire(t[part]) for n, t in new_state.items()}
            if job.state is None and job.request.episode_ids and new_state:
                self.episodes.scatter(policy.name, list(job.request.episode_ids), {n: t[part] for n, t in new_state.items()}, now)
            if act:
                values = None if result.value_estimates is None else wire(result.value_estimates[part])
                reply: Any = protocol.PolicyActReply(
                    qid=job.request.qid, actions=wire(result.actions[part]),
                    action_log_probs=wire(result.action_log_probs[part]), value_estimates=values,
                    new_hidden_states=hidden, version=result.version)
            else:
                reply = protocol.PredictReply(qid=job.request.qid, outputs={n: wire(t[part]) for n, t in outputs.items()},
                                              new_hidden_states=hidden, version=policy.version)
            replies.append((job.identity, reply))
        return replies

    # ------------------------------------------------------------------ weights, listing, stats
    def update_weights(self, message: protocol.PolicyWeights) -> str:
        """Apply a weight update; "" when applied, else why it was refused (logged, counted)."""
        policy = self.policies.get(message.model)
        why = ""
        if policy is None:
            why = f"no policy named {message.model!r} is served"
        elif message.version and message.version <= policy.version:
            why = f"version {message.version} is not newer than {policy.version}"
        else:
            try:
                policy.set_weights(message.weights, message.version or policy.version + 1)
            except PolicyLoadError as exc:
                why = str(exc)
        if why:
            self.counts.weights_rejected += 1
            log.warning("refused a weight update of policy %r: %s", message.model, why)
        else:
            self.counts.weights_updates += 1
            log.info("policy %s now at version %d", message.model, policy.version)
        return why

    def describe(self) -> list[protocol.PolicyInfo]:
        out = []
        for name, p in self.policies.items():
            dist = p.spec.distribution
            action = "" if dist is None else "categorical" if "logits" in dist.params else "gaussian"
            out.append(protocol.PolicyInfo(name=name, version=p.version, action=action, value=p.spec.value,
                                           signature=p.signature.to_json()))
        return out

    def stats(self) -> protocol.PolicyStats:
        c = self.counts
        c.episodes = len(self.episodes)
        c.episodes_expired = self.episodes.expired
        c.versions = {name: p.version for name, p in self.policies.items()}
        return protocol.PolicyStats(**{f: getattr(c, f) for f in c.__struct_fields__})


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
