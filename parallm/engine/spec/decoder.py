"""Speculative decoding in the engine's step: which rows speculate, their proposals (n-gram: ngram.py;
draft model: draft.py), the verification pass (verify.py; draft_verify.py) and what it emits
(docs/engine.md, "Speculative decoding").

A step speculates when speculation is on, the running rows are at most `disable_batch_size`, and
some row may (its k, control.py, is not 0; it uses no penalty and no grammar; verify.py says why)
and has a proposal. Such a step first reads the passes still in flight (the overlapped schedule's),
so every row's last token is known, then runs one verification pass over all running rows instead
of the decode pass: rows without a proposal decode their one token in it. Other steps decode as
without speculation (overlapped), so a batch that does not speculate pays only the proposer's
lookups.
"""

from __future__ import annotations

from typing import Callable

from parallm.config import SpecConfig
from parallm.protocol import SpecStats

from ..counters import StepCounters
from ..output import OutputProcessor, StepOutputs, unseen_versions
from ..runner import Launch, ModelRunner
from ..scheduler import Scheduler
from ..sequence import Sequence
from ..trace import StepTracer
from .control import SpecControl
from .draft import DraftProposer
from .draft_verify import verify_draft
from .ngram import Match, NGramProposer, continuation
from .verify import verify

NGRAM_K = 7  # spec.k 0 in mode ngram: a verify pass of 8 tokens (a whole multiple of spec.verify_multiple 4)
DRAFT_K = 4  # spec.k 0 in mode draft


class SpecDecoder:
    def __init__(self, config: SpecConfig, runner: ModelRunner, scheduler: Scheduler, output: OutputProcessor,
                 counters: StepCounters, trace: StepTracer, launches: list[Launch],
                 execute: Callable[[list], None], draft: DraftProposer | None = None) -> None:
        """`launches`: the engine's passes in flight (read here before a verify pass); `execute`: how the
        engine runs row ops; `draft`: the draft model's proposer (spec.mode draft; None: n-gram)."""
        self.runner = runner
        self.launches = launches
        self.execute = execute
        self.scheduler = scheduler
        self.output = output
        self.counters = counters
        self.trace = trace
        self.disable_batch_size = config.disable_batch_size
        self.proposer = NGramProposer(config.ngram_min, config.ngram_max)
        self.draft = draft
        k = config.k or (NGRAM_K if draft is None else DRAFT_K)
        self.control = SpecControl(k, config.min_acceptance, config.verify_multiple if draft is None else 1)
        self.steps_off_batch = 0  # steps not speculating because more rows ran than disable_batch_size

    def may_speculate(self, seq: Sequence) -> bool:
        """No processor whose state moves with the tokens: penalty counts, a grammar (or thinking gate)."""
        c = self.runner.constraints
        return not seq.uses_penalties and not (c is not None and c.constrained([seq]))

    def step(self, out: StepOutputs) -> int:
        """Speculate this step if it pays: read the passes in flight into `out` (and run the row moves
        of the rows they finished), verify, and account what each row emits into `out`. Returns the
        rows the verification pass ran (0: no speculation this step; the caller decodes)."""
        seqs = self.scheduler.running
        if not seqs:
            return 0
        if len(seqs) > self.disable_batch_size:
            self.steps_off_batch += 1
            return 0
        self._prune(seqs)
        ks = {s.seq_id: self.control.k(s.seq_id) for s in seqs if self.may_speculate(s)}
        if self.draft is None:
            if not any(self._ngram(s, ks.get(s.seq_id))[1] for s in seqs if s.seq_id in ks):
                return 0
        elif not any(ks.values()):
            return 0
        while self.launches:
            self.output.read(self.launches.pop(0), out)
        self.execute(self.scheduler.take_ops())
        seqs = self.scheduler.running
        if not seqs:
            return 0
        room = self.runner.live.capacity - max(s.num_computed for s in seqs) - 1

        def limit(s: Sequence, k: int | None) -> int:
            return max(0, min(k or 0, room, s.params.max_tokens - s.num_output - 1))

        # the verify pass writes a row's last token and its proposal: its table gets the blocks they
        # need where free ones are (a proposal the store cannot hold is cut)
        matches: list[Match | None] = []
        if self.draft is None:
            drafts = []
            for s in seqs:
                match, k = self._ngram(s, ks.get(s.seq_id)) if s.seq_id in ks else (None, 0)
                matches.append(match)
                drafts.append(continuation(s.token_ids, match, limit(s, k)) if match is not None and limit(s, k) else [])
            drafts = [d[:self._reserve(s, len(d))] if d else d for s, d in zip(seqs, drafts)]
            if not any(drafts):
                self._release_tails(seqs)
                return 0
            self.execute(self.scheduler.take_ops())  # the store grown to the blocks taken
            got = verify(self.runner, seqs, drafts)
            emitted = [got.emitted(i, d) for i, d in enumerate(drafts)]
            proposed = [len(d) for d in drafts]
        else:
            limits = [limit(s, ks.get(s.seq_id)) for s in seqs]
            limits = [self._reserve(s, k) if k else 0 for s, k in zip(seqs, limits)]
            if not any(limits):
                self._release_tails(seqs)
                return 0
            self.execute(self.scheduler.take_ops())  # the store grown to the blocks taken
            emitted = self._draft_verify(seqs, limits)
            proposed = limits
        self.control.verify_passes += 1
        self.trace.decode(len(seqs))
        self.counters.decoded(len(seqs))
        self.output.note_first_tokens(unseen_versions(seqs))
        for i, (s, k, e) in enumerate(zip(seqs, proposed, emitted)):
            self.runner.rollback(s, s.num_computed + len(e))  # the accepted positions; the rest is dropped
            if k:
                match = matches[i] if matches else None
                self.control.record(s.seq_id, k, len(e) - 1, adapt=match is None or not match.aligned)
                if match is not None:
                    self.proposer.accepted(s.seq_id, match, len(e) - 1)
        self._release_tails(seqs)
        for s, e in zip(list(seqs), emitted):
            for sampled, at in e:
                stop = self.output.accept(s, s.adapter_version, sampled, at, out)
                if stop is not None:
                    self.output.finish(s, stop, out)
                    break
        return len(seqs)

    def _draft_verify(self, seqs: list[Sequence], ks: list[int]) -> list[list]:
        """The draft proposes ks[i] tokens for each row with ks[i] > 0, the target verifies them (and
        decodes the other rows) in one pass, the draft rows keep what was accepted; each row's emitted
        (sampled columns, index) pairs."""
        draft = self.draft
        rows = [i for i, k in enumerate(ks) if k]
        prop = draft.propose([seqs[i] for i in rows], [ks[i] for i in rows], [s.seq_id for s in seqs])
        draft_row: list[int | None] = [None] * len(seqs)
        for r, i in enumerate(rows):
            draft_row[i] = r
        rejection = not draft.coupled  # spec.draft_acceptance rejection: sampled rows' proposals are tested by p/q
        got = verify_draft(self.runner, seqs, ks, prop, draft_row, rejection)
        emitted = [got.emitted(i, k, draft_row[i], rejection and s.params.temperature > 0)
                   for i, (s, k) in enumerate(zip(seqs, ks))]
        for r, i in enumerate(rows):
            draft.accepted(prop, r, len(emitted[i]) - 1)
        return emitted

    def _ngram(self, seq: Sequence, k: int | None) -> tuple[Match | None, int]:
        """`seq`'s n-gram match and how many tokens it proposes (control.ngram_k; `k`: the row's k() this
        step, None where it may not speculate)."""
        match = self.proposer.lookup(seq.seq_id, seq.token_ids)
        if match is None:
            return None, 0
        return match, self.control.ngram_k(k, match.n, match.aligned)

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Blocks in `seq`'s table for its last token and k proposed ones where the store has them; how
        many proposed positions fit (k or fewer)."""
        return max(0, min(k, self.scheduler.reserve(seq, seq.num_computed + 1 + k) - seq.num_computed - 1))

    def _release_tails(self, seqs: list[Sequence]) -> None:
        """Each row's table back to the blocks its next decode token needs (rollback's other half: the
        blocks of rejected positions go back to the store)."""
        for s in seqs:
            self.scheduler.truncate(s, s.num_computed + 1)

    def _prune(self, seqs: list[Sequence]) -> None:
        """Forget the rows no longer running (their index and control state come back if they do)."""
        if max(len(self.proposer), len(self.control)) <= 2 * len(seqs) + 16:
            return
        keep = {s.seq_id for s in seqs} | {s.seq_id for s in self.scheduler.prefilling}
        for key in [k for k in {*self.proposer.keys(), *self.control.keys()} if k not in keep]:
            self.proposer.forget(key)
            self.control.forget(key)
            if self.draft is not None:
                self.draft.forget(key)

    def reset(self) -> None:
        """Counters and per-row state back to none (warm-up's prompts are not the server's)."""
        self.control = SpecControl(self.control.k_max, self.control.min_acceptance, self.control.multiple)
        self.proposer = NGramProposer(self.proposer.n_min, self.proposer.n_max)
        if self.draft is not None:
            self.draft.reset()
        self.steps_off_batch = 0

    def stats(self) -> SpecStats:
        return SpecStats(mode="ngram" if self.draft is None else "draft", **self.control.stats(), steps_off_batch=self.steps_off_batch)
