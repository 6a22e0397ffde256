"""The engine stage's SeqOutput -> SeqDelta packing (no model, no sockets)."""

import math
import struct

import pytest

from parallm import protocol
from parallm.engine import SeqOutput
from parallm.stages.engine_replies import pack_step_ids, to_delta


def test_prompt_top_logprobs_skip_the_first_position():
    out = SeqOutput(rid="r", index=0, token_ids=[5], logprobs=[-0.5], top_logprobs=[[(5, -0.5), (7, -1.5)]],
                    prompt_logprobs=[None, -2.0, -3.0],
                    prompt_top_logprobs=[None, [(4, -1.0), (9, -2.0)], [(3, -0.1), (8, -3.0)]])
    delta = to_delta(out)
    assert protocol.unpack_ids(delta.token_ids) == [5]
    assert protocol.unpack_ids(delta.top_ids) == [5, 7]
    lps = protocol.unpack_floats(delta.prompt_logprobs)
    assert math.isnan(lps[0]) and lps[1:] == [-2.0, -3.0]
    assert protocol.unpack_ids(delta.prompt_top_ids) == [4, 9, 3, 8]
    assert protocol.unpack_floats(delta.prompt_top_logprobs) == pytest.approx([-1.0, -2.0, -0.1, -3.0])


@pytest.mark.parametrize("ids", [[], [0], [5], [2**31 - 1], [1, 2, 3], list(range(40000, 40017))])
def test_step_ids_pack_to_the_same_bytes_as_protocol(ids):
    assert pack_step_ids(ids) == protocol.pack_ids(ids)
    assert to_delta(SeqOutput(rid="r", index=0, token_ids=ids)).token_ids == protocol.pack_ids(ids)


def test_a_token_id_outside_int32_is_refused():
    with pytest.raises(struct.error):
        pack_step_ids([2**31])
