"""The policy stage: non-LLM policies and networks (`/v1/rl/act`, `/v1/predict`, raw clients).

One loop over two sockets: its ROUTER, where DEALERs (ingress, raw clients) send PolicyAct, Predict,
ListPolicies and GetStats and get each answer back; and its bound SUB, where trainers' PUBs publish
PolicyWeights. Requests are batched per model (parallm/policies/batcher.py): the loop waits for more
only until the oldest request's flush bound (policies.flush_us), sleeping when that is under a
millisecond (ZeroMQ's poll counts whole milliseconds).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable

import zmq

from parallm import protocol
from parallm.config import Config
from parallm.policies import Policy, PolicyLoadError
from parallm.policies.service import PolicyService
from parallm.runtime import StageRuntime
from parallm.transport import Receiver, Router, open_socket

log = logging.getLogger("parallm.policy")


class PolicyStage:
    def __init__(self, config: Config, runtime: StageRuntime, service: PolicyService) -> None:
        self.config = config
        self.rt = runtime
        self.service = service
        ctx, addrs, hwm = runtime.ctx, runtime.addrs, config.transport.hwm
        self.router = Router(open_socket(ctx, zmq.ROUTER, addrs.policy, bind=True, hwm=hwm),
                             accepts=protocol.PolicyInbound, on_rejected=self.router_send, name="policy")
        sub = open_socket(ctx, zmq.SUB, addrs.policy_weights, bind=True, hwm=hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.weights = Receiver(sub, protocol.PolicyWeightsInbound, name="policy weights")
        self.poller = zmq.Poller()
        self.poller.register(self.router.sock, zmq.POLLIN)
        self.poller.register(sub, zmq.POLLIN)
        self.handlers: dict[type, Callable[[bytes, Any], None]] = {
            protocol.PolicyAct: self.on_request,
            protocol.Predict: self.on_request,
            protocol.ListPolicies: lambda who, m: self.router_send(
                who, protocol.PolicyList(qid=m.qid, policies=self.service.describe())),
            protocol.GetStats: lambda who, m: self.router_send(
                who, protocol.StatsReply(qid=m.qid, stats=self.stats())),
        }

    def router_send(self, identity: bytes, message: protocol.Message) -> None:
        self.router.send(identity, message)

    def on_request(self, identity: bytes, message: protocol.PolicyAct | protocol.Predict) -> None:
        for who, reply in self.service.submit(identity, message, time.monotonic()):
            self.router_send(who, reply)

    def stats(self) -> protocol.PolicyStats:
        stats = self.service.stats()
        stats.dropped_frames = self.router.dropped + self.weights.dropped
        return stats

    def _timeout_ms(self, beat_ms: int) -> int:
        """How long to wait for messages: until the next batch's flush bound. ZeroMQ's poll counts whole
        milliseconds, so a shorter wait sleeps (the requests arriving meanwhile are queued, not lost) and
        then only drains: no spinning on a shared machine."""
        deadline = self.service.next_deadline()
        if deadline is None:
            return beat_ms
        left = deadline - time.monotonic()
        if left >= 0.001:
            return min(beat_ms, int(left * 1000))
        if left > 0:
            time.sleep(left)
        return 0

    def run(self) -> int:
        beat_ms = max(1, int(self.config.supervisor.heartbeat_s * 1000))
        while not self.rt.shutting_down:
            events = dict(self.poller.poll(self._timeout_ms(beat_ms)))
            if self.router.sock in events:
                for identity, message in self.router.drain(1024):
                    self.handlers[type(message)](identity, message)
            if self.weights.sock in events:
                for update in self.weights.drain(16):
                    self.service.update_weights(update)
            for identity, reply in self.service.run_due(time.monotonic(), flush_all=self.rt.draining):
                self.router_send(identity, reply)
            self.rt.poll_control()
            self.rt.heartbeat(lambda: len(self.service.batcher))
        return 0


def load_policies(entries: list[str]) -> dict[str, Policy]:
    """The policies of `policies.models` (NAME=PATH each)."""
    out = {}
    for entry in entries:
        name, _, path = entry.partition("=")
        out[name] = Policy.load(name, path)
    return out


def main(config: Config, replica: int = 0) -> int:
    runtime = StageRuntime(config, "policy", replica)
    try:
        policies = load_policies(config.policies.models)
    except (PolicyLoadError, OSError) as exc:
        runtime.fatal(f"cannot load a policy: {exc}")
        return 2
    p = config.policies
    service = PolicyService(policies, max_batch=p.max_batch, flush_us=p.flush_us, episode_ttl_s=p.episode_ttl_s,
                            max_episodes=p.max_episodes, max_queued_rows=p.max_queued_rows)
    stage = PolicyStage(config, runtime, service)
    gc.freeze()  # the loaded modules and weights: never scanned again by the collector between batches
    runtime.ready({"policies": sorted(policies), "address": runtime.addrs.policy})
    try:
        return stage.run()
    finally:
        stage.router.close()
        stage.weights.close()
        runtime.close()
