"""The policy stage: non-LLM policies and networks (`/v1/rl/act`, `/v1/predict`, raw clients).

Two sockets: its ROUTER, where DEALERs (ingress, raw clients) send PolicyAct, Predict, ListPolicies and
GetStats and get each answer back on the same socket; and its bound SUB, where trainers' PUBs publish
PolicyWeights. The work between messages is running the batches that are due (parallm/policies: the
service batches per model, up to policies.max_batch rows or policies.flush_us). An idle poll waits until
the oldest request's flush bound; ZeroMQ's poll counts whole milliseconds, so a shorter wait sleeps and
then drains what arrived (the skeleton's loop, stages/skeleton.py, does the rest).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import zmq

from parallm import protocol
from parallm.config import Config
from parallm.policies import Policy, PolicyLoadError
from parallm.policies.service import PolicyService
from parallm.runtime import StageRuntime
from parallm.stages.skeleton import Handler, Stage
from parallm.transport import Receiver, Router, open_socket


class PolicyStage(Stage):
    log = logging.getLogger("parallm.policy")

    def __init__(self, config: Config, runtime: StageRuntime, service: PolicyService) -> None:
        super().__init__(config, runtime)
        self.service = service
        ctx, addrs, hwm = runtime.ctx, runtime.addrs, config.transport.hwm
        self.router = Router(open_socket(ctx, zmq.ROUTER, addrs.policy, bind=True, hwm=hwm), name="policy",
                             accepts=protocol.PolicyInbound, on_rejected=self.reply)
        sub = open_socket(ctx, zmq.SUB, addrs.policy_weights, bind=True, hwm=hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.weights = Receiver(sub, protocol.PolicyWeightsInbound, name="policy weights")
        self.listen(self.router, {
            protocol.PolicyAct: self.on_request,
            protocol.Predict: self.on_request,
            protocol.ListPolicies: lambda who, m: self.reply(who, protocol.PolicyList(
                qid=m.qid, policies=self.service.describe())),
            protocol.GetStats: lambda who, m: self.reply(who, protocol.StatsReply(qid=m.qid, stats=self.stats())),
        }, limit=1024)
        self.listen(self.weights, {protocol.PolicyWeights: self.service.update_weights}, limit=16)

    def reply(self, identity: bytes, message: protocol.Message) -> None:
        self.router.send(identity, message)

    def safely(self, handler: Handler, *args: Any) -> None:
        """The skeleton's, and a ROUTER request whose handler raised is answered (500) to the identity that
        asked: its messages carry no `reply_to` for the skeleton to answer at."""
        if len(args) != 2:
            return super().safely(handler, *args)
        identity, message = args
        try:
            handler(identity, message)
        except Exception as exc:  # noqa: BLE001 - one bad message must not take the stage down
            self.failed += 1
            self.log.exception("could not handle a %s", type(message).__name__)
            self.reply(identity, protocol.RequestError(rid=message.qid, status=500, code="internal_error", message=(
                f"the policy stage could not handle this request ({type(exc).__name__}); the server logged why")))

    def on_request(self, identity: bytes, message: protocol.PolicyAct | protocol.Predict) -> None:
        for who, reply in self.service.submit(identity, message, time.monotonic()):
            self.reply(who, reply)

    def work(self) -> bool:
        """Run the batches that are due (every waiting one while the server drains)."""
        for who, reply in self.service.run_due(time.monotonic(), flush_all=self.rt.draining):
            self.reply(who, reply)
        return False

    def idle_wait_ms(self) -> int:
        deadline = self.service.next_deadline()
        if deadline is None:
            return self.beat_ms
        left = deadline - time.monotonic()
        if left >= 0.001:
            return min(self.beat_ms, int(left * 1000))
        if left > 0:
            time.sleep(left)
        return 0

    def in_flight(self) -> int:
        return len(self.service.batcher)

    def stats(self) -> protocol.PolicyStats:
        stats = self.service.stats()
        stats.dropped_frames = self.router.dropped + self.weights.dropped
        return stats


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
