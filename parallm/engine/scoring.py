"""Teacher-forced scoring in the engine: `add_score` queues it as prefill-only work of the engine's
steps, `score` runs steps until it is done. EngineScoring is a base of Engine (engine.py), which sets
every attribute annotated below."""

from __future__ import annotations

from typing import Callable
from typing import Sequence as Seq

from parallm.adapters import AdapterError, LoadedAdapter, VersionPolicy
from parallm.protocol import SamplingParams

from .plan import KVBudget
from .request import RequestRejected, ScoreResult, SeqOutput, validate_score
from .scheduler import Scheduler
from .sequence import Sequence

SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # a score samples nothing; its rows never decode


class EngineScoring:
    vocab_size: int
    max_model_len: int
    budget: KVBudget
    scheduler: Scheduler
    versions: VersionPolicy
    _requests: dict[str, list[Sequence]]
    _owed: list[SeqOutput | ScoreResult]
    _seq_counter: int
    _score_counter: int
    _cache_key: Callable[[LoadedAdapter | None], str]
    step: Callable[[], list[SeqOutput | ScoreResult]]

    def add_score(self, qid: str, ids: Seq[int], start: int = 1, top_logprobs: int = 0, adapter: str = "",
                  adapter_version: int = 0) -> None:
        """Queue a teacher-forced score of ids[start:] under the raw model distribution (of
        `adapter`, a pinned version or the latest): prefill-only work, batched with the prompts in
        the steps' prefill passes, through the prefix cache for the positions before start-1. The
        `step()` that finishes it returns a ScoreResult with this `qid` (aborted ones too)."""
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise RequestRejected("token ids must be integers", "ids") from None
        if not isinstance(qid, str) or not qid:
            raise RequestRejected("a score needs a non-empty query id", "qid")
        if qid in self._requests:
            raise RequestRejected(f"query id {qid!r} is already in use", "qid")
        validate_score(ids, start, top_logprobs, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if not self.scheduler.fits_alone(len(ids) + self.scheduler.headroom):
            raise RequestRejected(f"scoring {len(ids)} ids needs more KV memory than the engine has "
                                  f"({self.budget.budget_tokens} token slots in the block store)", "ids")
        try:
            lora = self.versions.resolve(adapter, adapter_version)
        except AdapterError as exc:
            raise RequestRejected(exc.message, "adapter", status=exc.status, code=exc.code) from None
        self._seq_counter += 1
        seq = Sequence(seq_id=self._seq_counter, rid=qid, index=0, prompt_ids=ids, params=SCORE_PARAMS, seed=0,
                       adapter=self._cache_key(lora), adapter_name=lora.name if lora else "",
                       adapter_version=lora.version if lora else 0, lora=lora, pinned=True, score_start=start,
                       score_top=top_logprobs)
        self._requests[qid] = [seq]
        self.scheduler.add([seq])

    def score(self, ids: Seq[int], start: int = 1, top_logprobs: int = 0, adapter: str = "",
              adapter_version: int = 0) -> ScoreResult:
        """`add_score`, then steps until it is done (in-process convenience): other requests advance
        in those steps, and their outputs are kept for the next `step()` or `flush()`."""
        self._score_counter += 1
        qid = f"__score_{self._score_counter}"
        self.add_score(qid, ids, start, top_logprobs, adapter, adapter_version)
        while True:
            outputs = self.step()
            for o in outputs:
                if isinstance(o, ScoreResult) and o.qid == qid:
                    self._owed.extend(x for x in outputs if x is not o)
                    return o
            self._owed.extend(outputs)
