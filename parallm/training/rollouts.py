"""Where a trainer's rollouts come from.

- `GeneratedRollouts`: the trainer asks the server for them through the raw ZeroMQ client, one
  batch (prompts_per_step prompts x group_size samples, submitted together so they batch) per
  ticket. A thread does the asking, so with `prefetch` tickets outstanding the next batch is
  sampled while the current one trains (each prefetched batch is one version behind).
- `SubscribedRollouts`: the trainer learns from what other clients sample, read from the
  server's rollout PUB stream (topic: the adapter name), grouped by request id.

Both hand out `Group`s; staleness filtering is the trainer's (it knows the current version).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import zmq

from parallm import protocol
from parallm.client import Client, ClientError
from parallm.config import RLTrainingConfig
from parallm.protocol import SamplingParams
from parallm.transport import open_socket

from .tasks import Conversation, Task, TaskPrompt

log = logging.getLogger("parallm.trainer")

RETRIES = 5


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]
    versions: list[tuple[int, int]]        # [(first token index, policy version), ...]
    finish_reason: str | None
    text: str = ""

    @property
    def oldest_version(self) -> int:
        return min((v for _, v in self.versions), default=0)


@dataclass
class Group:
    """One prompt and its sampled completions."""

    messages: Conversation
    info: dict[str, Any]
    prompt_ids: list[int]
    completions: list[Completion]
    rid: str = ""
    sampled_s: float = 0.0                 # wall time the batch it came in took to sample
    scores: list[float] | None = None      # rewards given with the rollouts (Atropos); None: the task scores them
    tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.tokens = sum(len(c.ids) for c in self.completions)


Encode = Callable[[Conversation], list[int]]
Decode = Callable[[Sequence[int]], str]


class GeneratedRollouts:
    """Batches of groups sampled on request by a thread with its own raw client."""

    def __init__(self, router: str, *, task: Task, encode: Encode, decode: Decode, adapter: str,
                 cfg: RLTrainingConfig, timeout_s: float, rng: random.Random) -> None:
        self.router, self.task, self.encode, self.decode = router, task, encode, decode
        self.adapter, self.cfg, self.timeout_s, self.rng = adapter, cfg, timeout_s, rng
        self._tickets: queue.Queue[int | None] = queue.Queue()
        self._batches: queue.Queue[list[Group] | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)
        self._stop = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def request(self) -> None:
        """Ask for one more batch (sampled with whatever version is latest when it is submitted)."""
        self._tickets.put(1)

    def get(self, timeout_s: float | None = None) -> list[Group]:
        item = self._batches.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._tickets.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _params(self) -> SamplingParams:
        c = self.cfg
        return SamplingParams(temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens, logprobs=True,
                              seed=self.rng.getrandbits(62))

    def _run(self) -> None:
        client: Client | None = None
        try:
            client = Client(self.router, timeout=self.timeout_s, identity=f"trainer-rollouts-{id(self):x}")
            while not self._stop.is_set():
                if self._tickets.get() is None:
                    return
                self._batches.put(self._sample(client))
        except BaseException as exc:  # handed to the training loop, which decides
            self._batches.put(exc)
        finally:
            if client is not None:
                client.close()

    def _sample(self, client: Client) -> list[Group]:
        prompts: list[TaskPrompt] = [self.task.sample(self.rng) for _ in range(self.cfg.prompts_per_step)]
        ids = [self.encode(p.messages) for p in prompts]
        params = [self._params() for _ in prompts]
        for attempt in range(RETRIES):
            t0 = time.perf_counter()
            try:
                rids = [client.submit(i, p, n=self.cfg.group_size, adapter=self.adapter) for i, p in zip(ids, params)]
                results = [client.result(rid) for rid in rids]
                break
            except ClientError as exc:
                if not exc.retryable or attempt == RETRIES - 1:
                    raise
                log.warning("rollout batch failed (%s); retrying in %d s", exc, 2 ** attempt)
                time.sleep(2 ** attempt)
        elapsed = time.perf_counter() - t0
        groups = []
        for prompt, prompt_ids, rid, samples in zip(prompts, ids, rids, results):
            completions = [Completion(ids=s.token_ids, logprobs=s.logprobs, versions=list(s.versions),
                                      finish_reason=s.finish_reason, text=self.decode(s.token_ids))
                           for s in samples]
            groups.append(Group(messages=prompt.messages, info=prompt.info, prompt_ids=prompt_ids,
                                completions=completions, rid=rid, sampled_s=elapsed))
        return groups


class SubscribedRollouts:
    """Groups assembled from the rollout PUB stream: the samples of one request id form a group,
    complete at `group_size` samples, or released after `group_timeout_s` with two or more."""

    def __init__(self, address: str, *, adapter: str, decode: Decode, group_size: int, group_timeout_s: float,
                 ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = open_socket(self.ctx, zmq.SUB, address, bind=False)
        self.sock.setsockopt(zmq.SUBSCRIBE, adapter.encode())
        self.adapter = adapter
        self.decode = decode
        self.group_size = group_size
        self.group_timeout_s = group_timeout_s
        self.decoder = protocol.Decoder(protocol.Rollout)
        self._open: dict[str, tuple[float, list[protocol.Rollout]]] = {}
        self.received = 0
        self.malformed = 0

    def _group(self, rollouts: list[protocol.Rollout]) -> Group:
        first = rollouts[0]
        prompt_ids = protocol.unpack_ids(first.prompt_ids)
        meta = first.metadata or {}
        messages = meta.get("messages")
        if not isinstance(messages, list):
            messages = [{"role": "user", "content": self.decode(prompt_ids)}]
        info = meta.get("info") if isinstance(meta.get("info"), dict) else {}
        completions = []
        for r in sorted(rollouts, key=lambda r: r.index):
            ids = protocol.unpack_ids(r.completion_ids)
            completions.append(Completion(ids=ids, logprobs=protocol.unpack_floats(r.logprobs),
                                          versions=[tuple(v) for v in r.versions],  # type: ignore[misc]
                                          finish_reason=r.finish_reason, text=self.decode(ids)))
        return Group(messages=messages, info=dict(info), prompt_ids=prompt_ids, completions=completions, rid=first.rid,
                     sampled_s=max(0.0, first.finished_at - first.submitted_at))

    def get(self, groups: int, *, stop: threading.Event | None = None) -> list[Group]:
        """Block until `groups` groups are ready (or `stop` is set: then whatever is ready)."""
        ready: list[Group] = []
        while len(ready) < groups and not (stop is not None and stop.is_set()):
            if self.sock.poll(100, zmq.POLLIN):
                _, payload = self.sock.recv_multipart()
                try:
                    rollout = self.decoder.decode(payload)
                except protocol.ProtocolError:
                    self.malformed += 1
                    continue
                self.received += 1
                if rollout.adapter != self.adapter or not rollout.completion_ids:
                    continue
                started, members = self._open.setdefault(rollout.rid, (time.monotonic(), []))
                members.append(rollout)
                if len(members) >= self.group_size:
                    del self._open[rollout.rid]
                    ready.append(self._group(members))
            now = time.monotonic()
            for rid, (started, members) in list(self._open.items()):
                if now - started > self.group_timeout_s:
                    del self._open[rid]
                    if len(members) >= 2:
                        ready.append(self._group(members))
        return ready

    def close(self) -> None:
        self.sock.close(0)
