"""Every message that crosses a socket, as a closed typed struct, and the one codec for them.

Each message is a MessagePack map with a `type` tag and the protocol version `v`, so any msgpack
library can speak it (docs/protocol.md). Token id arrays travel as packed little-endian int32 bytes
and float arrays as packed little-endian float32 bytes. Nothing else in parallm defines a wire
message, and nothing is pickled.

The package is split by concern; every public name is re-exported here, so callers write
`from parallm import protocol` / `from parallm.protocol import X` and never name a submodule:
- base: the protocol version, the `Message` base, the request parts (RequestSpec, SamplingParams, ...)
- to_tokenizer, to_engine, to_detokenizer, to_policy, to_clients, supervisor: the messages, by who receives them, each
  module ending with the union its receiver's socket accepts (EngineInbound, ...); to_ranks: what a tensor-parallel
  group's ranks exchange (one struct per engine call)
- replies: the answers to control requests (routed to `reply_to`); stats: what stages report (plain values)
- codec: encode / decode / reply_address, the only codec, and AnyMessage (every receiver's union)
- arrays: packed id and float arrays, version spans; tensors: pixel values (dtype, shape, bytes); merge: coalescing a late reader's outputs
A new message is one file's change here: its struct in the module of its receiver, its type in that
module's union and in its `__all__` (AnyMessage and this package take it from there).
"""

from .arrays import *  # noqa: F401,F403 - each module's __all__ is its public names
from .base import *  # noqa: F401,F403
from .codec import *  # noqa: F401,F403
from .merge import *  # noqa: F401,F403
from .replies import *  # noqa: F401,F403
from .stats import *  # noqa: F401,F403
from .supervisor import *  # noqa: F401,F403
from .tensors import *  # noqa: F401,F403
from .to_clients import *  # noqa: F401,F403
from .to_detokenizer import *  # noqa: F401,F403
from .to_engine import *  # noqa: F401,F403
from .to_policy import *  # noqa: F401,F403
from .to_ranks import *  # noqa: F401,F403
from .to_tokenizer import *  # noqa: F401,F403
