"""The engine process's pooling work: requests waiting for a pooling model (parallm/pooling/), taken in
priority order (lower first, then arrival, as generation) and run in batched prefill-only passes under a
token budget. No sockets here: the engine stage feeds it Submits with RequestSpec.pooling and sends what
`step` returns; tests drive it directly. It refuses as the engine does (RequestRejected)."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from ..pooling.heads import truncate_dims
from ..pooling.model import PoolingModel
from ..protocol import PoolingSpec
from .request import RequestRejected


@dataclass(order=True)
class _Job:
    priority: int
    arrival: int
    rid: str = field(compare=False)
    ids: list[int] = field(compare=False)
    spec: PoolingSpec = field(compare=False)


@dataclass(frozen=True)
class Pooled:
    """One finished pooling request: its vector and how many prompt tokens it took."""

    rid: str
    vector: np.ndarray     # float32 [dims] (or [dimensions] when truncated)
    prompt_tokens: int


class PoolingQueue:
    def __init__(self, models: dict[str, PoolingModel], batch_tokens: int = 512) -> None:
        self.models = models
        self.batch_tokens = batch_tokens
        self._heap: list[_Job] = []
        self._live: set[str] = set()
        self._arrivals = itertools.count()
        self.requests = self.tokens = self.batches = 0

    def validate(self, ids: list[int], spec: PoolingSpec) -> PoolingModel:
        """The model a request names, or RequestRejected (404 for an unknown model, 400 otherwise)."""
        model = self.models.get(spec.model)
        if model is None:
            served = ", ".join(sorted(self.models)) or "none"
            raise RequestRejected(f"pooling model '{spec.model}' is not served (served: {served})", "model",
                                  status=404, code="model_not_found")
        info = model.info
        if spec.task != info.task:
            raise RequestRejected(f"pooling model '{spec.model}' is a {info.task} model, not {spec.task}", "model")
        if spec.dimensions and not info.allows_dimensions(spec.dimensions):
            why = (f"one of {list(info.matryoshka)}" if info.matryoshka else f"at most {info.dims}") \
                if info.matryoshka is not None else "not supported: the model declares no Matryoshka dimensions"
            raise RequestRejected(f"dimensions {spec.dimensions}: {why}", "dimensions")
        if not ids:
            raise RequestRejected("the input is empty", "input")
        if len(ids) > info.max_len:
            raise RequestRejected(f"the input has {len(ids)} tokens; {spec.model} takes at most {info.max_len}",
                                  "input", code="context_length_exceeded")
        bad = next((i for i in ids if i < 0 or (info.vocab_size and i >= info.vocab_size)), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is outside {spec.model}'s vocabulary", "input")
        return model

    def add(self, rid: str, ids: list[int], spec: PoolingSpec, priority: int = 0) -> None:
        self.validate(ids, spec)
        if rid in self._live:
            raise RequestRejected(f"request id {rid!r} is already in flight", "request_id", status=409)
        heapq.heappush(self._heap, _Job(priority, next(self._arrivals), rid, ids, spec))
        self._live.add(rid)

    def abort(self, rid: str) -> bool:
        """Forget a waiting request (it gets no output); True if it was waiting."""
        if rid not in self._live:
            return False
        self._live.discard(rid)
        self._heap = [job for job in self._heap if job.rid != rid]
        heapq.heapify(self._heap)
        return True

    def rids(self) -> list[str]:
        return sorted(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def _take(self) -> list[_Job]:
        """The best waiting job and, behind it, jobs for the same model while their padded tokens fit the budget."""
        first = heapq.heappop(self._heap)
        batch, width, rest = [first], len(first.ids), []
        while self._heap:
            job = heapq.heappop(self._heap)
            grown = max(width, len(job.ids)) * (len(batch) + 1)
            if job.spec.model == first.spec.model and grown <= self.batch_tokens:
                batch.append(job)
                width = max(width, len(job.ids))
            else:
                rest.append(job)
                if job.spec.model != first.spec.model and len(rest) > 256:
                    break
        for job in rest:
            heapq.heappush(self._heap, job)
        return batch

    def step(self) -> list[Pooled]:
        """One batched pass over the best waiting requests of one model; [] when nothing waits."""
        if not self._heap:
            return []
        batch = self._take()
        model = self.models[batch[0].spec.model]
        vectors = model.run([job.ids for job in batch], max_tokens=self.batch_tokens)
        out = []
        for job, vector in zip(batch, vectors):
            self._live.discard(job.rid)
            if job.spec.dimensions:
                vector = truncate_dims(vector[None], job.spec.dimensions)[0]
            out.append(Pooled(job.rid, vector, len(job.ids)))
        self.requests += len(batch)
        self.tokens += sum(len(job.ids) for job in batch)
        self.batches += 1
        return out
