"""A step's row operations (plan.RowOp) on the live KV, the prefix pool and the penalty state, run
in order as if one at a time, with as few device evaluations as that allows: on a GPU each
evaluation waits a round trip, the first for the pass in flight."""

from __future__ import annotations

import mlx.core as mx

from .cache import LiveKV
from .plan import CopyRow, InitRow, LoadPrefix, Resize, RowOp, SwapRows, WriteBack
from .pool import KVPool
from .sampling import PenaltyState


def execute_row_ops(ops: list[RowOp], live: LiveKV, pool: KVPool, penalties: PenaltyState, block_size: int) -> None:
    """Runs of write-backs, of row copies and of prefix loads each read the device in one evaluation:
    a copy joins the run unless it reads a row the run has written; a sampling-state reset (InitRow)
    touches no KV and joins a run of prefix loads."""
    run: list[RowOp] = []
    for op in ops:
        if run and not _joins(run, op):
            _run_batch(run, live, pool, penalties, block_size)
            run = []
        if isinstance(op, (WriteBack, CopyRow, LoadPrefix)):
            run.append(op)
        elif isinstance(op, InitRow):
            if op.seq.uses_penalties:
                penalties.activate(live.rows)
                penalties.init_row(op.row, op.seq.prompt_ids, op.seq.output_ids)
        elif isinstance(op, Resize):
            live.resize(op.rows, op.capacity)
            penalties.resize(op.rows)
        elif isinstance(op, SwapRows):
            pairs = [(op.a, op.b), (op.b, op.a)]
            live.copy_rows(pairs, op.ntokens)
            penalties.copy_rows(pairs)
        else:  # pragma: no cover
            raise TypeError(f"unknown row op {op!r}")
    if run:
        _run_batch(run, live, pool, penalties, block_size)


def _joins(run: list[RowOp], op: RowOp) -> bool:
    """Whether `op` can run in one batch with the ops of `run`."""
    kind = type(run[0])
    if kind is LoadPrefix:
        return isinstance(op, (LoadPrefix, InitRow))
    if type(op) is not kind:
        return False
    if kind is CopyRow:  # reading a row the run writes would read it before that write
        return op.src not in {o.dst for o in run}
    return True


def _run_batch(run: list[RowOp], live: LiveKV, pool: KVPool, penalties: PenaltyState, block_size: int) -> None:
    if isinstance(run[0], WriteBack):
        _write_back(run, live, pool, block_size)
    elif isinstance(run[0], CopyRow):
        pairs = [(op.src, op.dst) for op in run]
        live.copy_rows(pairs, [op.ntokens for op in run])
        penalties.copy_rows(pairs)
    else:  # prefix loads (the InitRows between them ran as they came)
        for op, data in zip(run, pool.read_many([op.block_ids for op in run])):
            live.write_prefix(op.row, data)


def _write_back(ops: list[WriteBack], live: LiveKV, pool: KVPool, block_size: int) -> None:
    """Copy blocks of live rows into the prefix pool: every read is materialized in one evaluation
    (one device round trip for the whole step, not one per row)."""
    reads = []
    for op in ops:
        pos = mx.array([j * block_size + t for j, _ in op.blocks for t in range(block_size)], dtype=mx.int32)
        reads.append(live.read_positions(op.row, pos, materialize=False))
    live.settle()  # the reads also run the step's row writes before them
    mx.eval(reads)
    for op, data in zip(ops, reads):
        pool.write([bid for _, bid in op.blocks], data)
