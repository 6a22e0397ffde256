"""engine.prefix_partial_blocks: a prompt whose next block is not cached whole starts from a copy of the
cached block after the same prefix that shares most of its leading tokens, so a shared system prompt shorter
than a block is reused to the token (the CPU's 32-token blocks recomputed up to 31 tokens of it)."""

import random

import numpy as np
import pytest

from _engine_helpers import TINY_VOCAB, greedy, req, run_all, tiny_model, tracked_engine as new, wide_heads_model
from parallm.config import KVConfig
from parallm.engine.plan import CopyBlocks

SYSTEM = [random.Random(1).randrange(3, TINY_VOCAB) for _ in range(26)]  # shorter than a 32-token block


def user(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _logprobs(results, rid):
    return np.array(results[(rid, 0)]["logprobs"])


@pytest.mark.parametrize("bits", [0, 8], ids=["model-dtype", "kv-bits-8"])
def test_a_shared_prefix_shorter_than_a_block_is_reused_and_gives_the_same_tokens(engines, model, bits):
    kv = KVConfig(bits=8, group_size=32) if bits else None  # quantized: heads 32 wide (mx.quantize's groups)
    model = wide_heads_model("llama") if bits else model
    first, second = SYSTEM + user(20, 2), SYSTEM + user(25, 3)
    params = greedy(12, logprobs=True)
    e = new(engines, model, block_size=32, kv=kv)
    run_all(e, [req("a", first, params)])
    before = e.stats()
    got = run_all(e, [req("b", second, params)])
    after = e.stats()
    assert after.prefix_partial_hits - before.prefix_partial_hits == 1
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == len(SYSTEM)
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(second) - len(SYSTEM)
    assert got[("b", 0)]["usage"].cached_tokens == len(SYSTEM)
    cold = run_all(new(engines, model, block_size=32, kv=kv, prefix_cache=False), [req("b", second, params)])
    assert got[("b", 0)]["tokens"] == cold[("b", 0)]["tokens"]
    np.testing.assert_allclose(_logprobs(got, "b"), _logprobs(cold, "b"), atol=1e-5)
    assert e.stats().kv_blocks_used == 0  # the copy's source was held for the step only


def test_off_it_hits_whole_blocks_only(engines, model):
    e = new(engines, model, block_size=32, prefix_partial_blocks=False)
    run_all(e, [req("a", SYSTEM + user(20, 2), greedy(4))])
    run_all(e, [req("b", SYSTEM + user(25, 3), greedy(4))])
    assert (e.stats().prefix_partial_hits, e.stats().prefix_hit_tokens) == (0, 0)


def test_prompts_admitted_together_copy_in_one_op_and_keep_their_tokens(engines, model):
    e = new(engines, model, block_size=32)
    run_all(e, [req("a", SYSTEM + user(40, 2), greedy(4))])  # keys its first block
    prompts = {f"r{i}": SYSTEM + user(10 + 7 * i, 10 + i) for i in range(4)}
    prompts["long"] = SYSTEM + user(40, 2)[:30] + user(9, 20)  # a full block hit, then 24 of the second
    for rid, ids in prompts.items():
        e.add_request(req(rid, ids, greedy(10)))
    copies = []
    runner_execute = e.runner.execute

    def execute(ops, reach):
        copies.extend(len(op.pairs) for op in ops if isinstance(op, CopyBlocks))
        return runner_execute(ops, reach)

    e.runner.execute = execute
    got = run_all(e)
    assert sum(copies) == 5 and max(copies) > 1 and e.stats().prefix_partial_hits == 5
    cold = run_all(new(engines, model, block_size=32, prefix_cache=False),
                   [req(rid, ids, greedy(10)) for rid, ids in prompts.items()])
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in cold.items()}


def test_the_last_prompt_token_is_always_computed(engines, model):
    """A prompt that is a cached block's first tokens hits all but its last token (its logits are the
    first output's)."""
    e = new(engines, model, block_size=32)
    run_all(e, [req("a", SYSTEM + user(20, 2), greedy(4))])
    before = e.stats()
    got = run_all(e, [req("b", SYSTEM[:20], greedy(6))])
    assert e.stats().prefix_hit_tokens - before.prefix_hit_tokens == 19
    cold = run_all(new(engines, model, block_size=32, prefix_cache=False), [req("b", SYSTEM[:20], greedy(6))])
    assert got[("b", 0)]["tokens"] == cold[("b", 0)]["tokens"]
