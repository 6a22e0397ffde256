"""What the passes sampled, turned into outputs: tokens appended to their sequences, stop and
length checks, finishing (the row and blocks released, the finish reason, usage), prompt logprobs.

The engine's step is schedule, run, process; this is the process part (nano-vllm's
`Scheduler.postprocess`, grown by what parallm reports): one `SeqOutput` per sequence and step
(one per adapter version when a Resume moved the sequence between two passes read in one step),
logprobs and top-k alternatives, and the prompt's logprobs on the first output of index 0.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable

from parallm.protocol import Usage

from .plan import PrefillWork, RowOp
from .request import ScoreResult, SeqOutput
from .runner import FirstTokens, Launch
from .sampling import SampledLists
from .scheduler import Scheduler
from .sequence import Sequence


class StepOutputs:
    """What one step hands back, filled in as its passes are read."""

    __slots__ = ("seqs", "scores")

    def __init__(self) -> None:
        self.seqs: dict = {}  # seq_id -> its output ((seq_id, version) for an earlier version's)
        self.scores: list[ScoreResult] = []

    def items(self) -> list[SeqOutput | ScoreResult]:
        return [*self.seqs.values(), *self.scores] if self.scores else list(self.seqs.values())

    def __bool__(self) -> bool:
        return bool(self.seqs or self.scores)


def unseen_versions(seqs: Iterable[Sequence]) -> list:
    """The adapter versions these sequences run under that have not had a first token yet."""
    return list({id(s.lora): s.lora for s in seqs if s.lora is not None and not s.lora.first_token_at}.values())


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: Iterable[int], requests: dict[str, list[Sequence]],
                 execute: Callable[[list[RowOp]], None]) -> None:
        """`requests`: the engine's live requests (rid -> sequences), forgotten here once all are
        finished; `execute`: runs row ops on the runner (finishing a sequence moves rows)."""
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.requests = requests
        self.execute = execute
        self.aborted: list[Sequence] = []  # aborted since the last step: reported by the next one
        self.finish_as: dict[int, str] = {}  # seq_id -> finish reason of an abort that is not "abort"
        self.generated = 0
        self.prompt_computed = 0
        self.scored = 0  # positions scored by finished score requests
        self.swap_ms: deque[float] = deque(maxlen=64)  # adapter load -> its first token read, ms

    # ------------------------------------------------------------------ aborts
    def defer_abort(self, seqs: list[Sequence], finish: str = "abort") -> None:
        self.aborted.extend(seqs)
        if finish != "abort":
            self.finish_as.update((s.seq_id, finish) for s in seqs)
        for rid in {s.rid for s in seqs}:
            self.forget_if_done(rid)

    def report_aborts(self, out: StepOutputs) -> None:
        for seq in self.aborted:
            if seq.prefill_only:
                out.scores.append(ScoreResult(qid=seq.rid, ids=seq.prompt_ids, start=seq.score_start, logprobs=[],
                                              aborted=True))
            else:
                out.seqs[seq.seq_id] = self.output(seq, finish=self.finish_as.pop(seq.seq_id, "abort"))
        self.aborted.clear()

    # ------------------------------------------------------------------ passes read back
    def prefill_done(self, work: PrefillWork, prompt_lps: dict, first: FirstTokens | None, out: StepOutputs) -> None:
        """Account a pass's prompt chunks: prompt logprobs, finished prompts joining the running
        rows, their first tokens, finished scores."""
        self.prompt_computed += sum(work.lengths)
        for seq in work.seqs:
            got = prompt_lps.get(seq.seq_id)
            if got is not None:
                first_position, lps, ids, vals, ranks = got
                del seq.prompt_logprobs[first_position - seq.logprobs_from:]  # recomputed after a preemption
                for j, lp in enumerate(lps):
                    top = None if ids is None else sorted(zip(ids[j], vals[j]), key=lambda x: -x[1])
                    seq.prompt_logprobs.append((lp, top, None if ranks is None else ranks[j]))
        ops = self.scheduler.complete_prefill(work)  # finished prompts (and their forks) join the running rows
        for seq in work.seqs:
            if seq.prefill_only and seq.is_finished:
                out.scores.append(self.score_result(seq))
                self.forget_if_done(seq.rid)
        stops = []
        if first is not None:
            for i, seq in enumerate(first.seqs):
                stops.append((seq, self.accept(seq, seq.adapter_version, first.sampled, i, out)))
            self.note_first_tokens(unseen_versions(first.seqs))
        self.execute(ops)  # InitRow starts penalty state from the prompt and the first token
        for seq, stop in stops:
            if stop is not None:
                self.finish(seq, stop, out)
        self.execute(self.scheduler.take_ops())  # rows freed by those finishes, before the decode

    def read(self, launch: Launch, out: StepOutputs) -> None:
        """Wait for a decode pass and account its tokens."""
        sampled = launch.out.read()
        self.note_first_tokens(launch.fresh)
        for i, seq in enumerate(launch.seqs):
            if seq.is_finished or seq.epoch != launch.epochs[i]:
                continue  # aborted, preempted or finished after this pass was launched
            seq.inflight -= 1
            version = launch.versions[i] if launch.versions else seq.adapter_version
            stop = self.accept(seq, version, sampled, i, out)
            if stop is not None:
                self.finish(seq, stop, out)

    def note_first_tokens(self, loras: list) -> None:
        """These adapter versions' first tokens were just read: record load -> first token."""
        for lora in loras:
            if not lora.first_token_at:
                lora.first_token_at = time.time()
                self.swap_ms.append(1000 * (lora.first_token_at - lora.loaded_at))

    # ------------------------------------------------------------------ one token, one sequence
    def accept(self, seq: Sequence, version: int, sampled: SampledLists, i: int, out: StepOutputs) -> bool | None:
        """Append row i of `sampled` to its sequence and its output of this step; returns whether
        it ends the sequence by a stop token (True) or by length (False), else None."""
        tok = sampled.tokens[i]
        seq.output_ids.append(tok)
        self.generated += 1
        outputs = out.seqs
        o = outputs.get(seq.seq_id)
        if o is not None and o.version != version and o.token_ids:
            # a Pause(keep)/Resume moved the sequence to a newer version between two passes read
            # in this step: one output per version, in order
            outputs[(seq.seq_id, o.version)] = outputs.pop(seq.seq_id)
            o = None
        if o is None:
            o = outputs[seq.seq_id] = self.output(seq)
            o.version = version
        o.token_ids.append(tok)
        p = seq.params
        if p.logprobs or p.top_logprobs:
            o.logprobs = (o.logprobs or []) + [sampled.logprobs[i]]
        if p.top_logprobs:
            pairs = sorted(zip(sampled.top_ids[i][:], sampled.top_logprobs[i][:]), key=lambda x: -x[1])[:p.top_logprobs]
            o.top_logprobs = (o.top_logprobs or []) + [pairs]
        stop = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)
        if stop or seq.num_output >= p.max_tokens:
            return stop
        return None

    def finish(self, seq: Sequence, stop: bool, out: StepOutputs) -> None:
        self.scheduler.finish(seq, "stop" if stop else "length")
        o = out.seqs[seq.seq_id]
        o.finish_reason = seq.finish_reason
        o.usage = usage(seq)
        self.forget_if_done(seq.rid)

    def output(self, seq: Sequence, finish: str | None = None) -> SeqOutput:
        o = SeqOutput(rid=seq.rid, index=seq.index, token_ids=[], finish_reason=finish, adapter=seq.adapter_name,
                      version=seq.adapter_version)
        if finish is not None:
            o.usage = usage(seq)
        if seq.index == 0 and seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent \
                and seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == seq.num_prompt - 1:
            seq.prompt_logprobs_sent = True
            o.prompt_logprobs = [None] + [lp for lp, _, _ in seq.prompt_logprobs]
            o.prompt_ranks = [None] + [rank for _, _, rank in seq.prompt_logprobs]
            if seq.params.prompt_logprobs:
                o.prompt_top_logprobs = [None] + [top[:seq.params.prompt_logprobs] for _, top, _ in seq.prompt_logprobs]
        return o

    def score_result(self, seq: Sequence) -> ScoreResult:
        lps = [lp for lp, _, _ in seq.prompt_logprobs]
        self.scored += len(lps)
        tops = [top for _, top, _ in seq.prompt_logprobs] if seq.score_top else None
        return ScoreResult(qid=seq.rid, ids=seq.prompt_ids, start=seq.score_start, logprobs=lps, top_logprobs=tops)

    def forget_if_done(self, rid: str) -> None:
        seqs = self.requests.get(rid)
        if seqs and all(s.is_finished for s in seqs):
            del self.requests[rid]


def usage(seq: Sequence) -> Usage:
    return Usage(prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output,
                 cached_tokens=max(0, seq.num_cached_first))
