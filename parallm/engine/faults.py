"""A pass that raises ends only the rows it concerns, where the engine can tell which they are.

A prefill pass holds only the prompts it computes: when it raises (a kernel error on one prompt's
shape, a device out of memory on a long prompt), what it wrote into the live KV rows and the
penalty state is undone, each of its prompts is computed again alone, and a prompt whose own pass
still raises ends with finish_reason "error" (its rows and blocks freed); the running rows decode
on in the same step. A mixed pass (prompt chunks riding in the decode pass) that raises before it
is read is undone the same way and the step runs its prompts and its decode rows as separate
passes. A decode pass concerns every running row: its failure still ends every request and
restarts the stage (stages/engine.py), since the state it leaves cannot be trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from .plan import PrefillWork

if TYPE_CHECKING:
    from .runner import ModelRunner
    from .sequence import Sequence

log = logging.getLogger("parallm.engine")


class Faulting(Protocol):
    """What a failed pass touches: the Engine's (parallm/engine/engine.py) runner, its count of requests
    ended by a failed pass, and abort."""

    runner: ModelRunner
    failed_rows: int

    def abort(self, rid: str, reason: str = "abort", index: int | None = None) -> bool: ...


@dataclass(slots=True)
class PassState:
    """The arrays a pass replaces (MLX arrays are immutable: a pass rebinds the live KV, state and
    penalty buffers to new ones), held so that a pass that raises can be undone by rebinding them."""

    keys: list[mx.array]
    values: list[mx.array]
    states: list[list[mx.array | None]]
    penalties: tuple[mx.array | None, mx.array | None]

    @classmethod
    def of(cls, runner: ModelRunner) -> PassState:
        live, pen = runner.live, runner.penalties
        return cls(list(live.keys), list(live.values), [list(slot) for slot in live.states], (pen.counts, pen.seen))

    def restore(self, runner: ModelRunner) -> None:
        live, pen = runner.live, runner.penalties
        live.keys, live.values, live.states = list(self.keys), list(self.values), [list(s) for s in self.states]
        if pen.active and self.penalties[0] is not None:
            pen.counts, pen.seen = self.penalties


def prefill_passes(engine: Faulting, work: PrefillWork) -> Iterator[tuple[PrefillWork, dict, object]]:
    """Run `work`'s prefill pass, yielding (work, prompt logprobs, first tokens) for what was
    computed: the whole work, or, if its pass raised, each prompt that its own pass computed."""
    runner = engine.runner
    before = PassState.of(runner)
    try:
        yield (work, *runner.prefill(work))
        return
    except Exception as exc:  # noqa: BLE001 - any failure of the pass: undone, then told apart below
        before.restore(runner)
        if len(work.seqs) == 1:
            fail_rows(engine, work.seqs, exc)
            return
        log.warning("a prefill pass of %d prompts failed (%s: %s); computing each alone", len(work.seqs),
                    type(exc).__name__, exc)
    failed: list[tuple[Sequence, Exception]] = []
    for i, seq in enumerate(work.seqs):
        one = PrefillWork(work.row0 + i, [seq], [work.starts[i]], [work.lengths[i]], work.lengths[i])
        before = PassState.of(runner)
        try:
            result = runner.prefill(one)
        except Exception as exc:  # noqa: BLE001 - this prompt's own pass: it alone fails
            before.restore(runner)
            failed.append((seq, exc))
            continue
        yield (one, *result)
    for seq, exc in failed:  # after every pass: an abort's row moves must not shift the rows still to compute
        fail_rows(engine, [seq], exc)


def fail_rows(engine: Faulting, seqs: list[Sequence], exc: Exception) -> None:
    """End every request of `seqs` with finish_reason "error" (outputs of the next step)."""
    rids = sorted({s.rid for s in seqs})
    log.error("a pass failed for request(s) %s only (%s: %s); they end with an error, the others go on",
              ", ".join(rids), type(exc).__name__, exc)
    engine.failed_rows += len(rids)
    for rid in rids:
        engine.abort(rid, reason="error")
