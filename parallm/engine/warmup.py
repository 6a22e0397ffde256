"""Every kind of pass run once before the first real request.

On the CPU each fused elementwise loop MLX builds is compiled on first use by the system C++
compiler (cached under /tmp/mlx per machine, ~0.3 s each), and the check that packed passes fit
the model runs the first time a step could mix; a request should not wait for either.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from parallm.protocol import RequestSpec, SamplingParams

from .request import Request, RequestRejected

if TYPE_CHECKING:
    from .engine import Engine


def warm_up(engine: "Engine") -> float:
    """A few short requests through every kind of pass (one row alone; rows of different lengths
    prefilled while another row decodes, then decoded under a mask), then a score (its pass keeps
    every position's logprobs and top-k). Prompts stay under one block, so nothing is cached;
    requests that do not fit a tiny context or KV budget are left out. Returns the seconds it took."""
    t0 = time.perf_counter()
    vocab = max(2, engine.vocab_size)
    short = max(1, min(engine.config.block_size - 4, engine.max_model_len - 4))  # no full block to cache
    waves = [[short], [short, max(1, short // 2), max(1, short // 3)]]
    for w, lengths in enumerate(waves):
        for i, n in enumerate(lengths):
            ids = [(7 * (i + j) + 1) % vocab for j in range(n)]
            params = SamplingParams(max_tokens=max(1, min(3, engine.max_model_len - n)), temperature=0.0,
                                    ignore_eos=True)
            try:
                engine.add_request(Request(f"__warm_up_{w}_{i}", ids, RequestSpec(params=params)))
            except RequestRejected:
                continue
            if w == 1 and i == 0:
                engine.step()  # it decodes while the others are prefilled
        while engine.has_work():
            engine.step()
    try:
        engine.score([(7 * j + 3) % vocab for j in range(short + 1)], start=1, top_logprobs=1)
    except RequestRejected:
        pass
    return time.perf_counter() - t0
