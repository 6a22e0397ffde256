"""The one codec: every frame is encoded and decoded here, checked against the union its socket
accepts; and who a message (or a rejected frame) is answered to."""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Union

import msgspec
from msgspec import Struct

from .base import PROTOCOL_VERSION, Message
from .supervisor import ControlMessage, SupervisorInbound
from .to_clients import ClientInbound, PolicyClientInbound, Rollout, TrainingStatus
from .to_detokenizer import DetokInbound, RequestError, RouterInbound
from .to_engine import EngineInbound
from .to_policy import PolicyInbound, PolicyWeightsInbound
from .to_ranks import RankAck, RankBatch, RankStart
from .to_tokenizer import TokenizerInbound

__all__ = ["AnyMessage", "ProtocolError", "rejection", "encode", "Decoder", "decode", "Address", "reply_address"]


AnyMessage = Union[TokenizerInbound, EngineInbound, DetokInbound, RouterInbound, ClientInbound, SupervisorInbound,
                   ControlMessage, Rollout, TrainingStatus, PolicyInbound, PolicyWeightsInbound, PolicyClientInbound,
                   RankBatch, RankAck, RankStart]
"""Every message: the receivers' unions (a new message in one of them is in this one too), what is
published (Rollout, for trainers) or pushed to ingress (TrainingStatus), and what tensor-parallel ranks
exchange."""

class ProtocolError(ValueError):
    """A frame that is not a valid message for the socket it arrived on. `reply` is the error to send
    back when the frame names who sent it (a `reply_to` and a `rid` or `qid`), else None."""

    def __init__(self, message: str, reply: "RequestError | None" = None) -> None:
        super().__init__(message)
        self.reply = reply


class _Sender(Struct):
    """Who a rejected frame came from, read leniently (unknown fields ignored)."""

    rid: str = ""
    qid: str = ""
    reply_to: bytes = b""


_sender_decoder = msgspec.msgpack.Decoder(_Sender)


def rejection(data: bytes, why: str, routed: bool = False) -> RequestError | None:
    """The 400 answer to a rejected frame, addressed to its sender; None when it names none (with
    `routed`, a frame that came on a ROUTER, whose identity is the address, needs no reply_to)."""
    try:
        sender = _sender_decoder.decode(data)
    except Exception:  # noqa: BLE001 - not even a map of the right field types: nobody to answer
        return None
    rid = sender.qid or sender.rid
    if not rid or not (sender.reply_to or routed):
        return None
    return RequestError(rid=rid, reply_to=sender.reply_to, status=400, code="invalid_message",
                        message=f"the message was rejected: {why}")


_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


class Decoder:
    """Decodes frames into one of the message types a socket accepts; anything else is a ProtocolError."""

    def __init__(self, accepted: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(accepted)

    def decode(self, data: bytes) -> Any:
        try:
            message = self._decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise ProtocolError(str(exc), rejection(data, str(exc))) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bad UTF-8 in a str is not a DecodeError
            raise ProtocolError(str(exc)) from None
        except RecursionError:
            raise ProtocolError("the frame nests maps or arrays too deeply") from None
        if message.v != PROTOCOL_VERSION:
            why = f"protocol version {message.v} is not supported (this server speaks {PROTOCOL_VERSION})"
            raise ProtocolError(why, rejection(data, why))
        return message


def decode(data: bytes, accepted: Any = AnyMessage) -> Any:
    return Decoder(accepted).decode(data)


Address = tuple[str, bytes]
"""Who a message is answered to: (the request id — a control request's qid —, the client's reply_to)."""


@functools.cache
def _address_fields(kind: type) -> Callable[[Any], Address] | None:
    fields = {f.name for f in msgspec.structs.fields(kind)}
    if "reply_to" not in fields:
        return None
    for id_field in ("rid", "qid"):
        if id_field in fields:
            return operator.attrgetter(id_field, "reply_to")
    return None


def reply_address(message: Message) -> Address | None:
    """Where an answer about `message` goes (a stage that fails to handle it sends its RequestError there),
    known from its type: a request names its `rid` and `reply_to`, a control request its `qid` and
    `reply_to`; None for a type that names neither (a step's outputs, a heartbeat) or a message that left
    them empty (a trainer's publish on the PUB socket)."""
    read = _address_fields(type(message))
    if read is None:
        return None
    address = read(message)
    return address if address[0] and address[1] else None
