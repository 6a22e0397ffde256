"""Every kind of pass run once before the first real request.

On the CPU each fused elementwise loop MLX builds is compiled on first use by the system C++
compiler (cached under /tmp/mlx per machine, ~0.3 s each), and the check that packed passes fit
the model runs the first time a step could mix; a request should not wait for either.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol, Sequence

from parallm.protocol import RequestSpec, SamplingParams

from .plan import length_bucket, length_buckets
from .request import Request, RequestRejected

if TYPE_CHECKING:
    from parallm.config import EngineConfig

    from .blocks import BlockManager
    from .scheduler import Scheduler


class Warmable(Protocol):
    """What warming up drives: the Engine's (parallm/engine/engine.py) request API and settings."""

    vocab_size: int
    max_model_len: int
    config: EngineConfig
    scheduler: Scheduler
    blocks: BlockManager | None

    def add_request(self, request: Request) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list: ...
    def score(self, ids: Sequence[int], start: int = 1, top_logprobs: int = 0) -> object: ...


def warm_up(engine: Warmable) -> float:
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
    if engine.scheduler.admission.buckets:
        warm_up_buckets(engine)
    return time.perf_counter() - t0


def bucket_shapes(max_prefill_tokens: int, max_rows: int) -> list[tuple[int, int, int]]:
    """(rows k, prompt length, padded length) of every prefill pass shape the buckets allow: k rows
    of up to max_prefill_tokens // k tokens each, padded to a bucket (plan.length_bucket)."""
    shapes = []
    for k in range(1, max_rows + 1):
        top = length_bucket(max(1, max_prefill_tokens // k), max_prefill_tokens)
        for b in length_buckets(max_prefill_tokens):
            if b <= top:
                shapes.append((k, min(b, max(1, max_prefill_tokens // k)), b))
    return shapes


def warm_up_buckets(engine: Warmable) -> int:
    """Run one prefill pass of every bucketed shape (engine.prefill_buckets): k prompts of the same
    length, one token each, then forget the prefix blocks they cached (the next wave's prompts
    must not hit them). Rows are not padded, so
    every row count up to max_prefill_rows is a shape of its own. Returns the shapes run."""
    cfg, vocab, ran = engine.config, max(2, engine.vocab_size), 0
    rows = min(cfg.max_prefill_rows, cfg.max_num_seqs)
    for k, n, _ in bucket_shapes(cfg.max_prefill_tokens, rows):
        if n + 1 > engine.max_model_len:
            continue
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            for i in range(k):
                ids = [(11 * i + 5 * j + n) % vocab for j in range(n)]
                engine.add_request(Request(f"__warm_up_bucket_{k}_{n}_{i}", ids, RequestSpec(params=params)))
        except RequestRejected:
            pass
        while engine.has_work():
            engine.step()
        if engine.blocks is not None:  # the next wave's prompts must not hit these
            engine.blocks.reset()
        ran += 1
    return ran
