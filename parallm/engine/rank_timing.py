"""Where a tensor-parallel step's time goes, per rank (issue 38): what engine stats report in
EngineStats.ranks (RankState.step_ms_mean, RankState.collective_us).

Each rank times its own share of a step, as mean milliseconds per engine step since the warm-up:
- every rank: the engine's own phases (`schedule`, `prefill`, `mixed`, `launch`: building and
  launching the decode pass on the host, `read`: the host waiting for a pass's tokens, which holds
  the forward and its collectives, since the all-sums run inside the pass's graph);
- rank 0: `plan`, sending the step's RankBatch (encoding it, taking the acks that arrived);
- a follower: `wait`, blocked for rank 0's next batch (an idle server's wait counts too: read it
  beside the steps' own phases), `replay`, the batch's calls other than the step (requests added,
  adapters loaded, ...), and `ack`, encoding and sending its RankAck.

The collectives cannot be timed apart inside a pass, so each rank also measures them alone once,
right after its warm-up, in lockstep with the others (`probe_collectives`): an all-sum of one decode
row's hidden state and of 64 rows', each evaluated on its own (the latency a host sync sees), and the
2 x layers all-sums of one decode step chained in one graph (what a pass's collectives cost at
least). A step's `read` well above that chain's time is the forward's own time, not the transport's.
"""

from __future__ import annotations

import time
from collections import Counter

import mlx.core as mx

PROBE_ROWS = (1, 64)
PROBE_REPEATS = 20


class RankPhases:
    """Seconds by phase of this rank's part of the steps (module docstring), beside the engine's own."""

    def __init__(self, *names: str) -> None:
        """`names`: the phases reported from the start, at 0 until they are timed."""
        self.phase_s: Counter[str] = Counter({name: 0.0 for name in names})

    def add(self, name: str, seconds: float) -> None:
        self.phase_s[name] += seconds

    def step_ms_mean(self, engine) -> dict[str, float]:
        """This rank's phases with the engine's, in mean ms per engine step."""
        steps = max(1, engine.steps)
        phases = {**engine.counters.phase_s, **self.phase_s}
        return {k: round(1000 * v / steps, 4) for k, v in phases.items()}


def model_dims(model) -> tuple[int, int] | None:
    """(hidden size, layers) of an mlx-lm model, or None where it does not say."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", None)
    layers = getattr(model, "layers", None)
    if not isinstance(hidden, int) or layers is None:
        return None
    return hidden, len(layers)


def probe_collectives(model, group: mx.distributed.Group, dtype: mx.Dtype | None = None,
                      repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """All-sum timings over `group` in microseconds (module docstring); every rank of the group must
    call it at the same point, with the same model. {} for a group of one or a model without dims."""
    dims = model_dims(model)
    if group.size() < 2 or dims is None:
        return {}
    hidden, layers = dims
    dtype = dtype or _weight_dtype(model)
    out: dict[str, float] = {}
    for rows in PROBE_ROWS:
        x = mx.ones((rows, hidden), dtype=dtype)
        mx.eval(mx.distributed.all_sum(x, group=group))  # the first one sets the pair up
        t0 = time.perf_counter()
        for _ in range(repeats):
            mx.eval(mx.distributed.all_sum(x, group=group))
        out[f"all_sum_{rows}row{'s' if rows > 1 else ''}"] = round(1e6 * (time.perf_counter() - t0) / repeats, 2)
    x = mx.ones((1, hidden), dtype=dtype)
    t0 = time.perf_counter()
    for _ in range(max(1, repeats // 4)):
        y = x
        for _ in range(2 * layers):  # attention's and the MLP's all-sum per layer
            y = mx.distributed.all_sum(y, group=group) * 0.5
        mx.eval(y)
    out[f"step_chain_{2 * layers}"] = round(1e6 * (time.perf_counter() - t0) / max(1, repeats // 4), 2)
    return out


def _weight_dtype(model) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
