"""BlockManager, pure Python: chained hashes, sharing, LRU eviction, integrity."""

import itertools
import random

import pytest

from parallm.engine import blocks as blocks_mod
from parallm.engine.blocks import NO_HASH, BlockManager, block_hash


def test_hash_is_chained_and_keyed_by_adapter():
    a = block_hash(NO_HASH, [1, 2, 3, 4])
    assert a == block_hash(NO_HASH, [1, 2, 3, 4])
    assert a != block_hash(NO_HASH, [1, 2, 3, 5])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(NO_HASH, [5, 6, 7, 8])
    assert block_hash(NO_HASH, [1, 2, 3, 4], "lora-a:3") != a
    assert block_hash(NO_HASH, [1, 2, 3, 4], "lora-a:3") != block_hash(NO_HASH, [1, 2, 3, 4], "lora-a:4")


def test_store_match_release_and_reuse():
    bm = BlockManager(4, 4)
    toks = list(range(20))
    got = bm.store([], toks, "", 3)
    assert [w for _, w in got] == [True, True, True]
    held = [b for b, _ in got]
    bm.check_integrity({b: 1 for b in held})
    assert bm.match(toks, "", 10) == held
    assert bm.match(toks[:11], "", 10) == held[:2]
    assert bm.match(toks, "other-adapter", 10) == []
    assert bm.match([99] + toks[1:], "", 10) == []
    # a second sequence with the same prefix shares the blocks (no writes)
    again = bm.store([], toks, "", 2)
    assert again == [(held[0], False), (held[1], False)]
    bm.release(held)
    bm.release([b for b, _ in again])
    bm.check_integrity({})
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 3, 1)
    # freed blocks keep their hash: still a hit
    assert bm.match(toks, "", 10) == held


def test_never_hashed_blocks_go_first_then_lru_eviction():
    bm = BlockManager(3, 2)
    a = [b for b, _ in bm.store([], [1, 2, 3, 4], "", 2)]
    bm.release(a[::-1])  # a[1] freed first: least recently used
    b = [bid for bid, _ in bm.store([], [9, 9], "", 1)]
    assert b[0] not in a  # the never-hashed block
    c = [bid for bid, _ in bm.store([], [8, 8], "", 1)]
    assert c == [a[1]] and bm.evictions == 1
    assert bm.match([1, 2, 3, 4], "", 2) == [a[0]]  # the chain survives up to the evicted block
    bm.release(b + c)
    bm.check_integrity({})


def test_partial_finds_the_block_sharing_most_leading_tokens_after_the_same_chain():
    bm = BlockManager(8, 4)
    first = [b for b, _ in bm.store([], [1, 2, 3, 4, 5, 6, 7, 8], "", 2)]
    other = [b for b, _ in bm.store([], [1, 2, 9, 9], "", 1)]
    lora = [b for b, _ in bm.store([], [1, 2, 3, 7], "lora-a:1", 1)]
    assert bm.partial([1, 2, 3, 0], "", NO_HASH) == (first[0], 3)
    assert bm.partial([1, 2, 9], "", NO_HASH) == (other[0], 3)  # fewer tokens than a block
    assert bm.partial([1, 5], "", NO_HASH) in {(first[0], 1), (other[0], 1)}
    assert bm.partial([0, 2, 3, 4], "", NO_HASH) is None
    assert bm.partial([1, 2, 3, 7], "lora-a:1", NO_HASH) == (lora[0], 4)
    assert bm.partial([1, 2, 3, 0], "lora-b:1", NO_HASH) is None  # another adapter's KV is not this one's
    # the second block's family is the first block's chain, not the root
    assert bm.partial([5, 6, 0, 0], "", NO_HASH) is None
    assert bm.partial([5, 6, 0, 0], "", bm.chain_hash(first[:1])) == (first[1], 2)
    bm.release(first + other + lora)
    bm.check_integrity({})
    assert bm.drop_cached() == 4 and bm.partial([1, 2, 3, 0], "", NO_HASH) is None and not bm.families
    bm.check_integrity({})


def test_an_evicted_block_leaves_its_family():
    bm = BlockManager(2, 2)
    a = [b for b, _ in bm.store([], [1, 2], "", 1)]
    bm.release(a)
    b = [bid for bid, _ in bm.store([], [3, 4], "", 1)]
    c = [bid for bid, _ in bm.store([], [5, 6], "", 1)]  # evicts [1, 2]
    assert bm.evictions == 1 and bm.partial([1, 9], "", NO_HASH) is None
    assert bm.partial([5, 9], "", NO_HASH) == (c[0], 1)
    bm.check_integrity({b[0]: 1, c[0]: 1})


def test_store_stops_when_no_block_is_free():
    bm = BlockManager(2, 2)
    got = bm.store([], [1, 2, 3, 4, 5, 6], "", 3)
    assert len(got) == 2
    bm.check_integrity({b: 1 for b, _ in got})


def test_collision_is_caught_by_token_ids(monkeypatch):
    monkeypatch.setattr(blocks_mod, "block_hash", lambda parent, tokens, adapter="": 42)
    bm = BlockManager(4, 2)
    first = bm.store([], [1, 2], "", 1)
    assert bm.match([3, 4], "", 1) == []  # same hash, different tokens: no false hit
    assert bm.store([], [3, 4], "", 1) == []  # and no clobbering of the resident block
    bm.check_integrity({first[0][0]: 1})


def test_integrity_catches_leaks_and_double_release():
    bm = BlockManager(4, 2)
    got = bm.store([], [1, 2], "", 1)
    with pytest.raises(AssertionError):
        bm.check_integrity({})  # a held block nobody accounts for
    bm.release([got[0][0]])
    with pytest.raises(AssertionError):
        bm.release([got[0][0]])


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_integrity(seed):
    rng = random.Random(seed)
    bm = BlockManager(12, 2)
    held: dict[int, list[int]] = {}
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(4)]
    for step in range(400):
        op = rng.random()
        if op < 0.5 or not held:
            sid = step
            toks = rng.choice(prefixes)[:rng.randrange(2, 13)] + [rng.randrange(5) for _ in range(rng.randrange(4))]
            hit = bm.match(toks, "", len(toks) // 2)
            bm.acquire(hit)
            got = bm.store(hit, toks, "", len(toks) // 2)
            for (bid, _), j in zip(got, range(len(hit), len(toks) // 2)):
                assert bm.blocks[bid].token_ids == tuple(toks[2 * j:2 * j + 2])
            held[sid] = hit + [b for b, _ in got]
            assert bm.match(toks, "", len(held[sid]))[:len(held[sid])] == held[sid]
            query = tuple(toks[2 * len(hit):2 * len(hit) + 2])
            keyed = [b for b in bm.blocks if b.family == (bm.chain_hash(hit), "")]
            best = max((_shared(query, b.token_ids) for b in keyed), default=0)
            found = bm.partial(query, "", bm.chain_hash(hit))
            assert (found[1] if found else 0) == best
            assert found is None or bm.blocks[found[0]].token_ids[:best] == query[:best]
        else:
            sid = rng.choice(list(held))
            bm.release(held.pop(sid))
        refs: dict[int, int] = {}
        for ids in held.values():
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        bm.check_integrity(refs)
    for ids in held.values():
        bm.release(ids)
    bm.check_integrity({})
    assert bm.num_used == 0


def _shared(a, b) -> int:
    """Leading tokens a and b have in common (brute force, against BlockManager.partial)."""
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b)))
