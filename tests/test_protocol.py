import msgpack
import pytest

from parallm import protocol as p


def test_messages_are_msgpack_maps_with_type_and_version():
    message = p.Submit(rid="r1", reply_to=b"c", prompt_ids=p.pack_ids([1, 2, 70000]),
                       spec=p.RequestSpec(params=p.SamplingParams(max_tokens=4, logit_bias={7: -5.0}), priority=-3))
    raw = msgpack.unpackb(p.encode(message), strict_map_key=False)
    assert raw["type"] == "submit" and raw["v"] == p.PROTOCOL_VERSION
    assert raw["prompt_ids"] == (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (70000).to_bytes(4, "little")
    assert p.decode(p.encode(message), p.EngineInbound) == message


def test_plain_msgpack_client_message_decodes():
    frame = msgpack.packb({"type": "submit", "v": 2, "rid": "x", "reply_to": b"me", "prompt_ids": p.pack_ids([5, 6]),
                           "spec": {"params": {"max_tokens": 3, "temperature": 0.0}, "priority": 1}})
    message = p.decode(frame, p.EngineInbound)
    assert isinstance(message, p.Submit)
    assert p.unpack_ids(message.prompt_ids) == [5, 6]
    assert message.spec.params.max_tokens == 3 and message.spec.n == 1 and message.spec.priority == 1


def test_version_1_frames_are_refused_with_the_version_named():
    frame = msgpack.packb({"type": "submit", "v": 1, "rid": "x", "reply_to": b"me", "prompt_ids": p.pack_ids([5])})
    with pytest.raises(p.ProtocolError, match="protocol version 1"):
        p.decode(frame, p.EngineInbound)


def test_one_request_spec_travels_whole():
    """TextSubmit, Submit and Track embed the same RequestSpec, and nothing else re-declares its fields."""
    spec_fields = set(p.RequestSpec.__struct_fields__) | set(p.SamplingParams.__struct_fields__)
    for message in (p.TextSubmit, p.Submit, p.Track):
        assert "spec" in message.__struct_fields__
        assert not spec_fields & (set(message.__struct_fields__) - {"v"}), message


def test_top_rows_and_version_spans_round_trip():
    rows = [[(3, -0.5), (9, -1.5)], [(4, -0.25), (1, -2.0)]]
    ids, lps = p.pack_top(rows)
    assert p.unpack_top(ids, lps, 2) == rows and p.unpack_top(b"", b"", 2) == []
    spans: p.VersionSpans = []
    for first, version in ((0, 1), (3, 1), (5, 2)):
        p.extend_spans(spans, first, version)
    assert spans == [(0, 1), (5, 2)]
    assert [p.version_at(spans, i) for i in (0, 4, 5, 9)] == [1, 1, 2, 2]


def test_every_reply_routes_back_and_stats_are_typed():
    for reply in p.REPLIES:
        assert {"qid", "reply_to"} <= set(reply.__struct_fields__)
    frame = p.encode(p.StatsReply(qid="q", stats=p.TokenizerStats(handled=3)))
    got = p.decode(frame, p.ClientInbound)
    assert isinstance(got.stats, p.TokenizerStats) and got.stats.handled == 3


@pytest.mark.parametrize("frame", [
    b"\x00garbage",
    msgpack.packb({"type": "submit", "v": 2}),                       # missing fields
    msgpack.packb({"type": "nope", "v": 2}),                         # unknown type
    msgpack.packb({"type": "abort", "v": 99}),                       # future version
    msgpack.packb({"type": "abort", "v": 2, "rids": "notalist"}),   # wrong type
    msgpack.packb({"type": "track", "v": 2, "rid": "x", "reply_to": b"", "prompt_ids": b"", "spec": {}}),  # wrong socket
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


@pytest.mark.parametrize("accepted", [p.EngineInbound, p.TokenizerInbound, p.DetokInbound, p.ClientInbound,
                                      p.RouterInbound, p.SupervisorInbound, p.ControlMessage])
def test_a_frame_nested_100k_deep_is_a_protocol_error(accepted):
    """One valid msgpack frame (300 KB, a map nested 100,000 deep) must not escape the decoder."""
    deep = b"\x81\xa1a" * 100_000 + b"\xc0"
    frame = msgpack.packb({"type": "submit", "v": 2, "rid": "x", "reply_to": b"x", "prompt_ids": b"",
                           "spec": {"metadata": {}}})[:-1] + deep
    for data in (deep, frame):
        with pytest.raises(p.ProtocolError):
            p.Decoder(accepted).decode(data)


def _frame(**fields) -> bytes:
    return msgpack.packb({"v": 2, **fields})


def test_enum_fields_are_checked_by_the_codec_and_the_sender_is_answered():
    """Issue 30: an abort `reason` outside FinishReason was copied into the step's finish_reason and made the
    detokenizer reject the whole step message (other requests' tokens lost). The codec rejects it at the
    door, with a 400 addressed to whoever the frame names."""
    frame = _frame(type="abort", rids=["x"], reason="my-reason", qid="q1", reply_to=b"me")
    with pytest.raises(p.ProtocolError) as err:
        p.decode(frame, p.EngineInbound)
    reply = err.value.reply
    assert (reply.rid, reply.reply_to, reply.status, reply.code) == ("q1", b"me", 400, "invalid_message")
    assert "my-reason" in reply.message or "enum" in reply.message.lower()
    assert "$.reason" in reply.message
    # a valid reason still decodes; an abort naming no one is dropped without an answer
    assert p.decode(_frame(type="abort", rids=["x"], reason="stop"), p.EngineInbound).reason == "stop"
    with pytest.raises(p.ProtocolError) as err:
        p.decode(_frame(type="abort", rids=["x"], reason="nope"), p.EngineInbound)
    assert err.value.reply is None


def test_a_constraint_kind_outside_the_enum_is_refused_to_the_submitter():
    def frame(kind):
        spec = {"params": {"constraint": {"kind": kind, "value": "x"}}}
        return _frame(type="submit", rid="r9", reply_to=b"c", prompt_ids=p.pack_ids([1]), spec=spec)

    with pytest.raises(p.ProtocolError) as err:
        p.decode(frame("python"), p.EngineInbound)
    assert (err.value.reply.rid, err.value.reply.reply_to) == ("r9", b"c")
    assert "constraint.kind" in err.value.reply.message
    assert p.decode(frame("regex"), p.EngineInbound).spec.params.constraint.kind == "regex"


def test_a_string_that_is_not_utf8_is_a_protocol_error():
    """msgspec raises UnicodeDecodeError (not a DecodeError) for a str field holding bad UTF-8; it escaped
    the Decoder, past every Receiver, into the stage's loop."""
    frame = msgpack.packb({"v": 2, "type": "abort", "rids": ["x"]}).replace(b"\xa1x", b"\xa1\xff")
    with pytest.raises(p.ProtocolError):
        p.decode(frame, p.EngineInbound)


def test_every_enum_field_is_a_literal():
    """The fields docs/protocol.md lists as enums are typed so that the codec checks them."""
    import typing

    def literal(struct, name):
        hint = typing.get_type_hints(struct)[name]
        return any(typing.get_origin(a) is typing.Literal for a in (hint, *typing.get_args(hint)))

    for struct, name in ((p.Abort, "reason"), (p.Constraint, "kind"), (p.Pause, "mode"), (p.AdapterPublish, "format"),
                         (p.SeqDelta, "finish_reason"), (p.Output, "finish_reason"), (p.Rollout, "finish_reason"),
                         (p.PauseState, "mode"), (p.TrainingStatus, "state")):
        assert literal(struct, name), (struct.__name__, name)
