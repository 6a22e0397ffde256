"""The scheduler-decoder core: continuous batching over a dense live KV and a block prefix cache.

Usable in-process without any socket; the engine stage drives exactly this API.
"""

from .compat import REFUSED_MODEL_TYPES, UnsupportedModel
from .engine import Engine
from .model import EngineModel
from .request import Request, RequestRejected, ScoreResult, SeqOutput, make_request

__all__ = ["Engine", "EngineModel", "Request", "RequestRejected", "make_request", "ScoreResult", "SeqOutput", "REFUSED_MODEL_TYPES",
           "UnsupportedModel"]
