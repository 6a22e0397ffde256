"""Every message that crosses a socket, as a closed typed struct, and the one codec for them.

Each message is a MessagePack map with a `type` tag and the protocol version `v`, so any msgpack
library can speak it (docs/protocol.md). Token id arrays travel as packed little-endian int32 bytes
and float arrays as packed little-endian float32 bytes. Nothing else in parallm defines a wire
message, and nothing is pickled.

The package is split by concern; every public name is re-exported here, so callers write
`from parallm import protocol` / `from parallm.protocol import X` and never name a submodule:
- base: the protocol version, the `Message` base, the request parts (RequestSpec, SamplingParams, ...)
- to_tokenizer, to_engine, to_detokenizer, to_clients, supervisor: the messages, by who receives them
- replies: the answers to control requests (routed to `reply_to`); stats: what stages report (plain values)
- receivers: the union each socket accepts; codec: encode / decode / reply_address, the only codec
- arrays: packed id and float arrays, version spans; merge: coalescing a late reader's outputs
A new message: its struct in the module of its receiver, its type in that receiver's union
(receivers.py and AnyMessage), its name here.
"""

from .arrays import (TopRow, VersionSpans, count_ids, extend_spans, pack_floats, pack_ids, pack_top, unpack_floats,
                     unpack_ids, unpack_top, version_at)
from .base import (PROTOCOL_VERSION, Constraint, ConstraintKind, DetokSpec, FinishReason, Message, RequestSpec,
                   SamplingParams, Usage)
from .codec import Address, Decoder, ProtocolError, decode, encode, rejection, reply_address
from .merge import coalesce_outputs
from .receivers import (REPLIES, AnyMessage, AnyReply, ClientInbound, ControlMessage, DetokInbound, EngineInbound,
                        RouterInbound, SupervisorInbound, TokenizerInbound)
from .replies import (AdapterInfo, AdapterList, AdapterLoaded, AdapterUnloaded, AdapterVersion, DetokenizeReply,
                      PauseState, PrefixCacheReset, Reply, ScoreReply, StatsReply, TokenizeReply, WeightsUpdated)
from .stats import (AdapterStats, BlasStats, BurstStats, DetokenizerStats, EngineStats, LoopStats, RankState,
                    StageStats, StepRecord, TokenizerStats, WeightsStatus)
from .supervisor import Drain, Fatal, Heartbeat, Ready, Shutdown, StageDown, StageUp
from .to_clients import Hello, Output, Outputs, Rollout, TrainingStatus, Welcome
from .to_detokenizer import RequestError, SeqDelta, StepOutputs, Track
from .to_engine import (Abort, AdapterPublish, AdapterUnload, ListAdapters, Pause, ReplicaStats, ResetPrefixCache,
                        Resume, Score, Submit, WeightsUpdate)
from .to_tokenizer import Detokenize, GetStats, TextSubmit, Tokenize

__all__ = [
    "TopRow", "VersionSpans", "count_ids", "extend_spans", "pack_floats", "pack_ids", "pack_top", "unpack_floats",
    "unpack_ids", "unpack_top", "version_at",
    "PROTOCOL_VERSION", "Constraint", "ConstraintKind", "DetokSpec", "FinishReason", "Message", "RequestSpec",
    "SamplingParams", "Usage",
    "Address", "Decoder", "ProtocolError", "decode", "encode", "rejection", "reply_address",
    "coalesce_outputs",
    "REPLIES", "AnyMessage", "AnyReply", "ClientInbound", "ControlMessage", "DetokInbound", "EngineInbound",
    "RouterInbound", "SupervisorInbound", "TokenizerInbound",
    "AdapterInfo", "AdapterList", "AdapterLoaded", "AdapterUnloaded", "AdapterVersion", "DetokenizeReply",
    "PauseState", "PrefixCacheReset", "Reply", "ScoreReply", "StatsReply", "TokenizeReply", "WeightsUpdated",
    "AdapterStats", "BlasStats", "BurstStats", "DetokenizerStats", "EngineStats", "LoopStats", "RankState",
    "StageStats", "StepRecord", "TokenizerStats", "WeightsStatus",
    "Drain", "Fatal", "Heartbeat", "Ready", "Shutdown", "StageDown", "StageUp",
    "Hello", "Output", "Outputs", "Rollout", "TrainingStatus", "Welcome",
    "RequestError", "SeqDelta", "StepOutputs", "Track",
    "Abort", "AdapterPublish", "AdapterUnload", "ListAdapters", "Pause", "ReplicaStats", "ResetPrefixCache",
    "Resume", "Score", "Submit", "WeightsUpdate",
    "Detokenize", "GetStats", "TextSubmit", "Tokenize",
]
