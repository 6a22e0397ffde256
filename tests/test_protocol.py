import msgpack
import pytest

from parallm import protocol as p


def test_messages_are_msgpack_maps_with_type_and_version():
    message = p.Submit(rid="r1", reply_to=b"c", prompt_ids=p.pack_ids([1, 2, 70000]),
                       params=p.SamplingParams(max_tokens=4, logit_bias={7: -5.0}))
    raw = msgpack.unpackb(p.encode(message), strict_map_key=False)
    assert raw["type"] == "submit" and raw["v"] == p.PROTOCOL_VERSION
    assert raw["prompt_ids"] == (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (70000).to_bytes(4, "little")
    assert p.decode(p.encode(message), p.EngineInbound) == message


def test_plain_msgpack_client_message_decodes():
    frame = msgpack.packb({"type": "submit", "v": 1, "rid": "x", "reply_to": b"me",
                           "prompt_ids": p.pack_ids([5, 6]), "params": {"max_tokens": 3, "temperature": 0.0}})
    message = p.decode(frame, p.EngineInbound)
    assert isinstance(message, p.Submit)
    assert p.unpack_ids(message.prompt_ids) == [5, 6]
    assert message.params.max_tokens == 3 and message.n == 1


@pytest.mark.parametrize("frame", [
    b"\x00garbage",
    msgpack.packb({"type": "submit", "v": 1}),                       # missing fields
    msgpack.packb({"type": "nope", "v": 1}),                         # unknown type
    msgpack.packb({"type": "abort", "v": 99}),                       # future version
    msgpack.packb({"type": "abort", "v": 1, "rids": "notalist"}),   # wrong type
    msgpack.packb({"type": "track", "v": 1, "rid": "x", "reply_to": b"", "n": 1, "prompt_ids": b""}),  # wrong socket
])
def test_bad_frames_raise_protocol_error(frame):
    with pytest.raises(p.ProtocolError):
        p.decode(frame, p.EngineInbound)


def test_packed_arrays_round_trip():
    assert p.unpack_ids(p.pack_ids([])) == []
    assert p.unpack_floats(p.pack_floats([-0.5, 1.25])) == [-0.5, 1.25]


def test_per_sequence_items_omit_defaults():
    raw = msgpack.unpackb(p.encode(p.StepOutputs(step=1, time=0.0, batch_size=1,
                                                 outputs=[p.SeqDelta(rid="a", token_ids=p.pack_ids([3]))])))
    assert raw["outputs"] == [{"rid": "a", "token_ids": p.pack_ids([3])}]
