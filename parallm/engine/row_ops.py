"""A step's row operations (plan.RowOp) on the per-row state (penalties, recurrent state) and the
block store, run in order. The KV itself moves with the block tables: only an n > 1 fork's partly
filled last block and a partial prefix hit's block are copied (CopyBlocks); row moves and copies touch
the per-row state alone."""

from __future__ import annotations

from .cache import LiveKV
from .plan import CopyBlocks, CopyRow, InitRow, Resize, RowOp, SwapRows
from .sampling import PenaltyState


def execute_row_ops(ops: list[RowOp], live: LiveKV, penalties: PenaltyState) -> None:
    """Consecutive row copies run as one batch (one evaluation) unless one reads a row the batch wrote."""
    run: list[CopyRow] = []
    for op in ops:
        if run and not (isinstance(op, CopyRow) and op.src not in {o.dst for o in run}):
            _copy(run, live, penalties)
            run = []
        if isinstance(op, CopyRow):
            run.append(op)
        elif isinstance(op, InitRow):
            if op.seq.uses_penalties:
                penalties.activate(live.rows)
                penalties.init_row(op.row, op.seq.prompt_ids, op.seq.output_ids)
        elif isinstance(op, Resize):
            live.resize(op.rows, op.capacity)
            penalties.resize(op.rows)
        elif isinstance(op, SwapRows):
            _copy([CopyRow(op.a, op.b, op.ntokens), CopyRow(op.b, op.a, op.ntokens)], live, penalties)
        elif isinstance(op, CopyBlocks):
            live.copy_blocks(op.pairs)
        else:  # pragma: no cover
            raise TypeError(f"unknown row op {op!r}")
    if run:
        _copy(run, live, penalties)


def _copy(run: list[CopyRow], live: LiveKV, penalties: PenaltyState) -> None:
    pairs = [(op.src, op.dst) for op in run]
    live.copy_rows(pairs)
    penalties.copy_rows(pairs)
