"""The trainer's TensorBoard event files (parallm/training/tensorboard.py), read back with TensorBoard's own
generated protobuf classes (tensorboardX.proto.event_pb2, a test dependency) and its record framing."""

from __future__ import annotations

import struct

import pytest

from parallm.training.tensorboard import EventWriter, _masked, crc32c, scalars

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")


def records(path) -> list[bytes]:
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert data[at + 8:at + 12] == _masked(header)
        body = data[at + 12:at + 12 + length]
        assert data[at + 12 + length:at + 16 + length] == _masked(body)
        out.append(body)
        at += 16 + length
    return out


def test_crc32c_known_value():
    assert crc32c(b"123456789") == 0xE3069283   # the CRC-32C check value (RFC 3720)


def test_steps_of_scalars_read_back_as_tensorboard_events(tmp_path):
    writer = EventWriter(tmp_path / "tb")
    line = {"step": 1, "loss": 0.25, "reward_mean": 0.5, "kl": None, "dtype": "quantized", "ok": True,
            "staleness_hist": {"0": 32}, "grad_norm": float("nan")}
    assert scalars(line) == {"step": 1.0, "loss": 0.25, "reward_mean": 0.5, "staleness_hist/0": 32.0}
    writer.add_scalars(1, scalars(line), wall_time=1000.5)
    writer.add_scalars(2, {"loss": -1.5}, wall_time=1001.0)
    writer.close()
    [path] = list((tmp_path / "tb").iterdir())
    assert path.name.startswith("events.out.tfevents.")
    events = [event_pb2.Event.FromString(r) for r in records(path)]
    assert events[0].file_version == "brain.Event:2"
    assert (events[1].step, events[1].wall_time) == (1, 1000.5)
    assert {v.tag: v.simple_value for v in events[1].summary.value} == scalars(line)
    assert (events[2].step, [(v.tag, v.simple_value) for v in events[2].summary.value]) == (2, [("loss", -1.5)])
