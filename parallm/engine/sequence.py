"""One generated sequence: a few counters plus derived properties.

Token accounting (P prompt tokens, G tokens generated and read back so far):
- `token_ids` = prompt + output. Prefill computes the KV of all of them and samples the next
  token from the last one's logits (the prefix cache never covers the last token, so there is
  always one to compute); from then on the last token is the next decode input, whose KV the
  decode pass computes.
- `num_computed`: positions [0, num_computed) of the sequence's row hold valid KV (or are
  scheduled to, when a decode is in flight).
- `inflight`: decode passes launched whose sampled token has not been read yet (0..2 with
  overlap). The position of the token a new decode samples is `num_output + inflight`.

A teacher-forced score (`score_start` >= 1) is a prefill-only sequence: its prompt is the ids to
score, its prefill keeps the logprobs of positions score_start-1 .. (each given the ids before
it), and it finishes when the prefill is done, without sampling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from parallm.protocol import SamplingParams

if TYPE_CHECKING:
    from .images import SeqImages


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    rid: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # base of this sequence's noise stream; token i uses (seed, i)
    adapter: str = ""  # prefix-cache identity: "" (base) or "name@version" (see follow())
    adapter_name: str = ""
    adapter_version: int = 0
    lora: object | None = None  # the parallm.adapters.LoadedAdapter this sequence runs under
    pinned: bool = False  # the request pinned its version: it never follows a newer one
    priority: int = 0  # lower is served first (see priority.py)
    group: "SeqGroup | None" = None  # set while n > 1 siblings still wait for the shared prefill

    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1
    num_computed: int = 0
    inflight: int = 0
    epoch: int = 0  # bumped when the row is lost (preemption/abort): in-flight tokens are dropped
    admitted_at: int = -1  # admission counter
    arrival: int = -1  # arrival counter (set when queued; n > 1 siblings share it)
    arrived_at: float = 0.0  # clock time it was queued, for the priority's aging
    block_ids: list[int] = field(default_factory=list)  # the block table: its KV's blocks (refs held), in order
    num_keyed: int = 0  # leading blocks of block_ids registered in the prefix cache (blocks.register)
    chain_hash: int = -1  # the key of block num_keyed-1 (blocks.NO_HASH when none)
    num_cached_first: int = -1  # prefix-cache hit of the first admission (usage.cached_tokens)
    finish_reason: str | None = None
    prompt_logprobs: list | None = None  # [(logprob, top, rank) per position from logprobs_from], filled by prefill
    prompt_logprobs_sent: bool = False
    score_start: int = 0  # >= 1: a teacher-forced score of prompt_ids[score_start:] (see the module doc)
    score_top: int = 0  # top-k alternatives a score keeps per position
    images: "SeqImages | None" = None  # a vision-language request's images (images.py); n > 1 siblings share them

    # ------------------------------------------------------------------ derived
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """The ids the prefix cache keys blocks by: the token ids, image tokens standing for their image."""
        return self.token_ids if self.images is None else self.images.cache_ids(self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """KV positions prefill computes: every token (the last one's logits give the next token)."""
        return self.num_tokens

    @property
    def prefill_remaining(self) -> int:
        return max(0, self.prefill_target - self.num_computed)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def scheduled_outputs(self) -> int:
        """Output tokens read back plus those in flight."""
        return len(self.output_ids) + self.inflight

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs or self.params.top_logprobs > 0

    @property
    def prefill_only(self) -> bool:
        """Finishes when its prefill is done, sampling nothing (a teacher-forced score)."""
        return self.score_start > 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None or self.score_start > 0

    @property
    def logprobs_from(self) -> int:
        """The first position whose logits' logprobs prefill keeps (of the next token)."""
        return self.score_start - 1 if self.score_start else 0

    @property
    def prompt_top_k(self) -> int:
        return self.score_top if self.score_start else (self.params.prompt_logprobs or 0)

    @property
    def uses_prefix_cache(self) -> bool:
        """Prompt logprobs need every position's logits, so such requests neither look up nor count."""
        return self.score_start > 0 or self.params.prompt_logprobs is None

    @property
    def cacheable_tokens(self) -> int:
        """How many leading tokens a prefix-cache hit may cover: never the last (its logits give the
        next token), for a score none from position score_start-1 on (their logits are the scores)."""
        if not self.uses_prefix_cache:
            return 0
        return self.score_start - 1 if self.score_start else self.num_tokens - 1

    @property
    def uses_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass(eq=False, slots=True)
class SeqGroup:
    """The n sequences of one request while they share a single prefill.

    The leader (index 0) is admitted and prefilled; the others wait here and are forked from
    the leader's row when its prefill completes.
    """

    leader: Sequence
    followers: list[Sequence]
