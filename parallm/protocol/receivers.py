"""What each socket accepts: one tagged union per receiver, which its Decoder checks every frame
against (a type outside it is a ProtocolError, never a surprise for a handler)."""

from __future__ import annotations

from typing import Union

from .replies import (AdapterList, AdapterLoaded, AdapterUnloaded, DetokenizeReply, PauseState, PrefixCacheReset,
                      ScoreReply, StatsReply, TokenizeReply, WeightsUpdated)
from .supervisor import Drain, Fatal, Heartbeat, Ready, Shutdown, StageDown, StageUp
from .to_clients import Hello, Outputs, Rollout, TrainingStatus, Welcome
from .to_detokenizer import RequestError, StepOutputs, Track
from .to_engine import (Abort, AdapterPublish, AdapterUnload, ListAdapters, Pause, ReplicaStats, ResetPrefixCache,
                        Resume, Score, Submit, WeightsUpdate)
from .to_tokenizer import Detokenize, GetStats, TextSubmit, Tokenize

REPLIES = (TokenizeReply, DetokenizeReply, ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList,
           StatsReply, WeightsUpdated, PrefixCacheReset)
AnyReply = Union[TokenizeReply, DetokenizeReply, ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList,
                 StatsReply, WeightsUpdated, PrefixCacheReset]

TokenizerInbound = Union[TextSubmit, Tokenize, Detokenize, GetStats]
EngineInbound = Union[Submit, Score, Abort, Pause, Resume, GetStats, AdapterPublish, AdapterUnload, ListAdapters,
                      WeightsUpdate, ResetPrefixCache, ReplicaStats]
DetokInbound = Union[Track, StepOutputs, RequestError, AnyReply]
ClientInbound = Union[Outputs, RequestError, Welcome, AnyReply]
RouterInbound = Union[Hello, GetStats]  # a client may ask the detokenizer for its stats
SupervisorInbound = Union[Ready, Heartbeat, Fatal]
ControlMessage = Union[StageDown, StageUp, Drain, Shutdown]
AnyMessage = Union[TextSubmit, Tokenize, Detokenize, GetStats, Submit, Score, Abort, Pause, Resume, AdapterPublish,
                   AdapterUnload, ListAdapters, Track, StepOutputs, RequestError, TokenizeReply, DetokenizeReply,
                   ScoreReply, PauseState, AdapterLoaded, AdapterUnloaded, AdapterList, StatsReply, Hello, Welcome,
                   Outputs, Rollout, TrainingStatus, Ready, Heartbeat, Fatal, StageDown, StageUp, Drain, Shutdown,
                   WeightsUpdate, WeightsUpdated, ResetPrefixCache, PrefixCacheReset, ReplicaStats]
