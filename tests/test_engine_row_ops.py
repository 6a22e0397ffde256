"""A step's row operations (ModelRunner.execute) move per-row state only: the KV stays in the
block store, and a batch of copies leaves what the ops one at a time leave."""

import mlx.core as mx

from parallm.engine.cache import LayerShape, LiveKV
from parallm.engine.pass_view import PassContext
from parallm.engine.plan import CopyBlocks, CopyRow, InitRow, Resize, SwapRows
from parallm.engine.row_ops import execute_row_ops
from parallm.engine.sampling import PenaltyState
from parallm.engine.state import SlotLayout, StateShape


class _Seq:
    uses_penalties = False


def _live():
    layout = SlotLayout(slots=(("kv", 0), ("state", 0)), states=(StateShape((((3,), mx.float32), None)),))
    live = LiveKV([LayerShape(2, 4, 2, 4)], mx.float32, layout, block_size=4)
    live.resize(6, 16)
    live.states[0][0] = mx.arange(18, dtype=mx.float32).reshape(6, 3)
    ctx = PassContext(0, [0], 8, 8, tables=[[0, 1]])
    live.views(ctx)[0].update_and_fetch(mx.ones((1, 2, 8, 4)), mx.ones((1, 2, 8, 4)))
    mx.eval(live.arrays())
    return live


OPS = [CopyRow(5, 0, 9), CopyRow(4, 5, 12), CopyRow(0, 3, 7),  # the third reads row 0 after the first wrote it
       InitRow(1, _Seq()), SwapRows(1, 2, 8), CopyRow(1, 4, 8), CopyRow(2, 1, 16), Resize(8, 32),
       CopyBlocks([(1, 2)])]


def test_row_ops_copy_state_and_no_kv():
    one, batched = _live(), _live()
    kv_before = [mx.array(a) for a in one.keys + one.values]
    for op in OPS:
        execute_row_ops([op], one, PenaltyState(10))
    execute_row_ops(OPS, batched, PenaltyState(10))
    assert mx.array_equal(one.states[0][0], batched.states[0][0]).item()
    assert one.states[0][0].shape == (8, 3)
    for a, b, before in zip(one.keys + one.values, batched.keys + batched.values, kv_before):
        assert mx.array_equal(a, b).item()
        assert mx.array_equal(a[:, :12], before[:, :12]).item()  # the trash block and blocks 0-1: untouched
        assert mx.array_equal(a[:, 12:16], before[:, 8:12]).item()  # block 2 := block 1 (copy-on-write)
    assert set(one.copied) == {"state", "cow"} and one.copied["cow"] == 4 * one.bytes_per_token
