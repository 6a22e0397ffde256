"""Every kind of pass, and every way of sampling, run once before the first real request.

On the CPU each fused elementwise loop MLX builds is compiled on first use by the system C++
compiler (cached under $TMPDIR/mlx per machine, 0.3-1.5 s each), and the check that packed passes fit
the model runs the first time a step could mix; a request should not wait for either. The sampler's
compiled functions (the Gumbel noise of a sampled row, the penalties, a grammar's mask) build loops of
their own, one set for a single row and another for several: with only greedy rows warmed, on a fresh
2-core machine the first request that sampled (the OpenAI default, temperature 1) ran 4.1 s of builds
in its steps, the first two sampled rows 2.9 s more, the first penalties 1.3 s and the first grammar mask
2.6 s, every running request waiting through them (issue 30). Those waves cost ~2 s of a start on that
machine, so on the CPU they run only while the first sampled wave still builds loops: once a warm-up on the
machine has built them all, later starts (an engine restarted by the supervisor, every test server) find
them in the cache and stop after that wave (not the ranks of a tensor-parallel group: each would decide by
the cache of its own machine, and they must run the same steps).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import mlx.core as mx
import msgspec

from parallm.protocol import Constraint, RequestSpec, SamplingParams

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


GREEDY = SamplingParams(temperature=0.0)
# sampled rows beside a greedy one, the first alone for a step: the Gumbel noise, the penalties and the
# filters for one row and for several
SAMPLED_ROWS = [SamplingParams(temperature=1.0, seed=2, repetition_penalty=1.1, presence_penalty=0.1,
                               frequency_penalty=0.1),
                GREEDY,
                SamplingParams(temperature=0.7, seed=3, top_p=0.9, top_k=20, min_p=0.05, logprobs=True,
                               top_logprobs=2)]
CONSTRAINT = Constraint(kind="regex", value="[a-z]{1,3}")


def warm_up(engine: Warmable, grammars: Callable[[], bool] = lambda: False) -> float:
    """A few short requests through every kind of pass (one row alone; rows of different lengths, sampled
    beside a greedy one, the first decoding while the others are prefilled, then decoded under a mask), then
    a score (its pass keeps every position's logprobs and top-k). Unless that sampled wave found every loop
    it needed already built (cpu_loops), the same rows prefilled in one pass, and, if `grammars()` (which may
    wait for the constraints' tokenizer) says grammar constraints can be used, rows under a grammar staggered
    and together. Prompts stay under one block, so nothing is cached; requests that do not fit a tiny
    context or KV budget are left out. Returns the seconds it took."""
    t0 = time.perf_counter()
    short = max(1, min(engine.config.block_size - 4, engine.max_model_len - 4))  # no full block to cache
    lengths = [short, max(1, short // 2), max(1, short // 3)]
    _wave(engine, "0", [(short, GREEDY)])
    # a tensor-parallel group's ranks run the same steps, so none may decide by its own machine's cache
    before = cpu_loops() if engine.config.tensor_parallel <= 1 else 0
    _wave(engine, "1", list(zip(lengths, SAMPLED_ROWS)))
    if not (before and cpu_loops() == before):  # loops were built (or cannot be counted): build the rest now
        _wave(engine, "2", list(zip(lengths, SAMPLED_ROWS)), staggered=False, tokens=2)  # a prefill and a decode
        if grammars():
            sampled, greedy = (msgspec.structs.replace(p, constraint=CONSTRAINT) for p in SAMPLED_ROWS[:2])
            rows = list(zip(lengths, [sampled, greedy, SAMPLED_ROWS[2]]))
            _wave(engine, "c0", rows, ignore_eos=False, tokens=2)  # a grammar ends its output with EOS
            _wave(engine, "c1", rows, staggered=False, ignore_eos=False, tokens=2)
    vocab = max(2, engine.vocab_size)
    try:
        engine.score([(7 * j + 3) % vocab for j in range(short + 1)], start=1, top_logprobs=1)
    except RequestRejected:
        pass
    if engine.scheduler.admission.buckets:
        warm_up_buckets(engine)
    if engine.config.warm_decode_rows:
        warm_up_decode_rows(engine, engine.config.warm_decode_rows)
    return time.perf_counter() - t0


def cpu_loops() -> int:
    """How many fused loops MLX's CPU backend keeps compiled on this machine (its cache,
    $TMPDIR/mlx/<version>/cpu); 0 where that cannot be told (another device, no cache yet)."""
    if mx.default_device() != mx.cpu:
        return 0
    try:
        return sum(1 for _ in (Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu").glob("*.so"))
    except OSError:
        return 0


def _wave(engine: Warmable, name: str, rows: list[tuple[int, SamplingParams]], *, staggered: bool = True,
          ignore_eos: bool = True, tokens: int = 3) -> None:
    """Requests of (prompt length, sampling) run to their end: `staggered`, the first alone for a step and then
    decoding while the others are prefilled (a decode or mixed pass beside a prefill), else all prefilled in one
    pass. A request that does not fit is left out."""
    vocab = max(2, engine.vocab_size)
    for i, (n, params) in enumerate(rows):
        ids = [(7 * (i + j) + 1) % vocab for j in range(n)]
        p = msgspec.structs.replace(params, max_tokens=max(1, min(tokens, engine.max_model_len - n)), ignore_eos=ignore_eos)
        try:
            engine.add_request(Request(f"__warm_up_{name}_{i}", ids, RequestSpec(params=p)))
        except RequestRejected:
            continue
        if staggered and i == 0 and len(rows) > 1:
            engine.step()
    while engine.has_work():
        engine.step()


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


def warm_up_decode_rows(engine: Warmable, rows: int) -> int:
    """Decode passes of every row count from 1 to `rows` (at most max_num_seqs): one short greedy request
    admitted per step, each asked for as many tokens as let the rows end together, so the decode batch grows
    by one row a step and then empties at once. On MLX CUDA a decode pass of a row count not run before
    launched ~5 ms slower (engine.warm_decode_rows); requests arrive unevenly when served, so a server meets
    new row counts for long after its start. The prompts stay under one block (nothing is cached); a request
    that does not fit ends the ramp early. Returns the largest row count decoded."""
    cfg, vocab = engine.config, max(2, engine.vocab_size)
    n = max(0, min(rows, cfg.max_num_seqs))
    length = max(1, min(cfg.block_size - 4, engine.max_model_len - n - 2, 8))
    if n == 0 or length + n + 1 > engine.max_model_len:
        return 0
    admitted = 0
    for i in range(n):
        ids = [(13 * i + 3 * j + 1) % vocab for j in range(length)]
        params = SamplingParams(max_tokens=n - i + 1, temperature=0.0, ignore_eos=True)
        try:
            engine.add_request(Request(f"__warm_up_rows_{i}", ids, RequestSpec(params=params)))
        except RequestRejected:
            break
        admitted += 1
        engine.step()
    while engine.has_work():
        engine.step()
    if engine.blocks is not None:  # the generated tokens' full blocks: no real prompt should hit them
        engine.blocks.reset()
    return admitted
