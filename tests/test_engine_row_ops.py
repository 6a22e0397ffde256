"""A step's row operations run in batches (ModelRunner.execute): the live KV ends as if each op ran
alone, in order, with fewer device evaluations (each one a round trip on a GPU)."""

import mlx.core as mx

from parallm.engine.plan import CopyRow, InitRow, LoadPrefix, WriteBack

from _engine_helpers import make_engine, tiny_model


def _runner():
    engine = make_engine(tiny_model("llama"), max_num_seqs=6, block_size=4)
    runner = engine.runner
    runner.live.resize(6, 16)
    runner.pool._ensure()
    for i, buf in enumerate(runner.live.arrays()):  # every row and position distinct
        buf[:] = mx.arange(buf.size, dtype=buf.dtype).reshape(buf.shape) + 1000 * i
    for i, buf in enumerate(runner.pool.arrays):
        buf[:] = -mx.arange(buf.size, dtype=buf.dtype).reshape(buf.shape) - 1000 * i
    mx.eval(runner.live.arrays(), runner.pool.arrays)
    return runner


class _Seq:
    uses_penalties = False


OPS = [
    WriteBack(0, [(0, 1), (1, 2)]), WriteBack(4, [(0, 3)]),
    CopyRow(5, 0, 9), CopyRow(4, 5, 12), CopyRow(0, 3, 7),  # the third reads row 0 after the first wrote it
    LoadPrefix(1, [0, 1]), InitRow(1, _Seq()), LoadPrefix(2, [2]), InitRow(2, _Seq()),
    CopyRow(1, 4, 8), CopyRow(2, 1, 16),
]


def test_batched_row_ops_leave_what_one_at_a_time_leaves(monkeypatch):
    one = _runner()
    for op in OPS:
        one.execute([op])
    batched = _runner()
    evals = []
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evals.append(1), real(*a)))
    batched.execute(OPS)
    monkeypatch.setattr(mx, "eval", real)
    mx.eval(one.live.arrays(), batched.live.arrays(), one.pool.arrays, batched.pool.arrays)
    for a, b in zip(one.live.arrays() + one.pool.arrays, batched.live.arrays() + batched.pool.arrays):
        assert mx.array_equal(a, b).item()
    # write-backs 1, copies 2 (split where one reads a row written before it), loads 1, copies 1
    assert len(evals) == 5
