"""The block store's bookkeeping, pure Python (modelled on nano-vllm's BlockManager): which block
ids hold what, for the live sequences and the prefix cache alike (one store, cache.LiveKV).

A block holds the KV of `block_size` consecutive tokens. A live sequence's KV is its block table
(`Sequence.block_ids`): blocks it got from `allocate` (written by its passes), blocks it matched
in the prefix cache, and blocks it shares with its n > 1 siblings (copy-on-write: only a partly
filled last block is ever copied). A full block gets a key (`register`): a chained hash of
(parent block's hash, the block's token ids, adapter identity), so a block is only ever reused
after exactly the same prefix under the same adapter; the token ids are kept too, to catch hash
collisions. Blocks are reference-counted by the live sequences that hold them. A block whose count
drops to zero keeps its hash (it can still be hit) and sits in an LRU list; a never-hashed free
block is used first (lowest id first, so the store only grows as far as the blocks in use reach),
unless more than `max_cached` blocks sit in the LRU list (the cache's share of the store), then the
least recently used is evicted first.

A prompt whose next block is not cached whole can still start from the cached block after the same
chain that shares the longest run of its leading tokens (`partial`): the scheduler copies that block
into one of its own and computes from the first token that differs (vLLM reuses whole blocks only,
SGLang's radix tree any prefix). Keyed blocks are indexed for it by (parent's key, adapter), each
family's blocks sorted by their token ids, so the longest common prefix is one of the two neighbours
of a prompt's place in that order.

An optional lower tier (`tier`, e.g. prefix_tier.PrefixDiskTier) hears of blocks keyed and evicted,
and may supply the blocks a lookup misses (`BlockTier`).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from ..hashing import NO_HASH, block_hash  # the keys (pure Python, importable without MLX)

__all__ = ["NO_HASH", "Block", "BlockManager", "BlockTier", "block_hash"]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()
    family: tuple[int, str] | None = None  # (parent's key, adapter) where `partial` finds it


class BlockTier(Protocol):
    """A store below the block store (the disk tier): told of keyed and evicted blocks, asked on a miss."""

    def stored(self, block_id: int, key: int, tokens: tuple[int, ...], adapter: str) -> None:
        """Block `block_id` got key `key`; the passes that computed its KV were launched."""

    def evicting(self, block_id: int, key: int, tokens: tuple[int, ...]) -> None:
        """Cached block `block_id` (key `key`) is about to be reused for another."""

    def fetch(self, parent: int, tokens: tuple[int, ...], adapter: str, keep: Sequence[int]) -> int | None:
        """A block installed (BlockManager.install) with the KV of `tokens` after `parent`, or None."""

    def forget(self) -> None:
        """Every cached block was forgotten (reset)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_cached: int | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.tier: BlockTier | None = None
        self.block_size = block_size
        self.max_cached = num_blocks if max_cached is None else max_cached
        self._num_blocks = num_blocks
        # blocks [0, peak) have been handed out at least once (`blocks`); ids from peak on are free
        # and never used, made as needed (a model with little KV per token can have 10^8 blocks)
        self.blocks: list[Block] = []
        self.hash_to_block: dict[int, int] = {}
        self.free_unhashed: list[int] = []  # a heap of freed ids below peak: lowest first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        # keyed blocks by (parent's key, adapter), each family sorted by (token ids, block id): `partial`
        self.families: dict[tuple[int, str], list[tuple[tuple[int, ...], int]]] = {}
        self.evictions = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def peak(self) -> int:
        """1 + the highest block id ever handed out: how far the physical store must reach."""
        return len(self.blocks)

    def reach(self, more: int) -> int:
        """How far the store must reach once `more` blocks are allocated (freed ids below the peak are
        handed out first), at most the whole budget."""
        return min(self._num_blocks, self.peak + max(0, more - len(self.free_unhashed)))

    @property
    def num_free(self) -> int:
        """Free and holding nothing reusable."""
        return len(self.free_unhashed) + self._num_blocks - len(self.blocks)

    @property
    def num_cached(self) -> int:
        """Free (no live reference) but still hashed, so a later request can hit them."""
        return len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    # ------------------------------------------------------------------ lookups
    def match(self, token_ids: Sequence[int], adapter: str, max_blocks: int) -> list[int]:
        """Ids of the longest cached chain of full blocks that prefixes `token_ids` (no refs taken)."""
        bs = self.block_size
        out: list[int] = []
        parent = NO_HASH
        for j in range(min(max_blocks, len(token_ids) // bs)):
            tokens = tuple(token_ids[j * bs:(j + 1) * bs])
            h = block_hash(parent, tokens, adapter)
            bid = self.hash_to_block.get(h)
            if bid is None and self.tier is not None:
                bid = self.tier.fetch(parent, tokens, adapter, out)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            out.append(bid)
            parent = h
        return out

    def partial(self, token_ids: Sequence[int], adapter: str, parent: int) -> tuple[int, int] | None:
        """(block id, n): the keyed block after chain `parent` whose first n token ids are the first n of
        `token_ids` (at most a block's), n as large as any such block has and at least 1; None if none.
        No reference is taken."""
        family = self.families.get((parent, adapter))
        query = tuple(token_ids[:self.block_size])
        if not family or not query:
            return None
        at = bisect_left(family, (query,))
        best: tuple[int, int] | None = None
        for tokens, bid in family[max(0, at - 1):at + 1]:
            n = _common_prefix(query, tokens)
            if n and (best is None or n > best[1]):
                best = (bid, n)
        return best

    def _index(self, block: Block, parent: int, adapter: str) -> None:
        block.family = (parent, adapter)
        insort(self.families.setdefault(block.family, []), (block.token_ids, block.block_id))

    def _unkey(self, block: Block) -> None:
        """Forget block's key: the hash map's entry and its place in its family."""
        if self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        if block.family is not None:
            family = self.families[block.family]
            at = bisect_left(family, (block.token_ids, block.block_id))
            if at < len(family) and family[at][1] == block.block_id:
                del family[at]
            if not family:
                del self.families[block.family]
        block.hash, block.token_ids, block.family = NO_HASH, (), None

    def install(self, h: int, tokens: tuple[int, ...], keep: Sequence[int] = ()) -> int | None:
        """Take a free block for key `h` (a lower tier's block coming back) and leave it cached, most
        recently used, with no reference; never one of `keep`. None when no block can be had."""
        for bid in keep:  # the chain being matched is not evicted for its own continuation
            if bid in self.free_cached:
                self.free_cached.move_to_end(bid)
        if not self.num_free and all(bid in keep for bid in self.free_cached):
            return None
        bid = self._take_free()
        if bid is None:
            return None
        block = self.blocks[bid]
        block.hash, block.token_ids = h, tokens
        self.hash_to_block[h] = bid
        self.free_cached[bid] = None
        return bid

    def chain_hash(self, block_ids: Sequence[int]) -> int:
        return self.blocks[block_ids[-1]].hash if block_ids else NO_HASH

    # ------------------------------------------------------------------ references
    def acquire(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                if block.hash == NO_HASH:  # pragma: no cover - only hashed blocks are matched
                    self.free_unhashed.remove(bid)
                    heapq.heapify(self.free_unhashed)
                else:
                    del self.free_cached[bid]
            block.ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise AssertionError(f"block {bid} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash == NO_HASH:
                    heapq.heappush(self.free_unhashed, bid)
                else:
                    self.free_cached[bid] = None

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks for a live sequence to write (a reference held on each, no key), or None (and
        nothing taken) when fewer than `n` are free or evictable."""
        if n > self.num_free + self.num_cached:
            return None
        out = []
        for _ in range(n):
            bid = self._take_free()
            self.blocks[bid].ref_count = 1
            out.append(bid)
        return out

    def register(self, table: list[int], first: int, token_ids: Sequence[int], adapter: str, parent: int,
                 num_blocks: int) -> tuple[int, int]:
        """Key full blocks first..num_blocks-1 of a sequence's block `table` (its tokens `token_ids`,
        `parent`: the hash of block first-1) so later requests can hit them. A block whose key another
        block already has is replaced in `table` by that one (the reference moves; same tokens after
        the same prefix: same KV), so duplicates are not kept. Stops at a hash collision. Returns
        (blocks now keyed, the hash of the last)."""
        bs = self.block_size
        for j in range(first, num_blocks):
            tokens = tuple(token_ids[j * bs:(j + 1) * bs])
            if len(tokens) < bs:
                return j, parent
            h = block_hash(parent, tokens, adapter)
            bid = table[j]
            found = self.hash_to_block.get(h)
            if found is None:
                block = self.blocks[bid]
                if block.hash != NO_HASH:  # keyed under another chain (cannot happen for own blocks)
                    return j, parent
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = bid
                self._index(block, parent, adapter)
                if self.tier is not None:
                    self.tier.stored(bid, h, tokens, adapter)
            elif found != bid:
                if self.blocks[found].token_ids != tokens:
                    return j, parent  # collision: keep the resident block, stop the chain here
                self.acquire([found])
                self.release([bid])
                table[j] = found
            parent = h
        return max(first, num_blocks), parent

    def store(self, held: Sequence[int], token_ids: Sequence[int], adapter: str,
              num_blocks: int) -> list[tuple[int, bool]]:
        """Register full blocks len(held)..num_blocks-1 of `token_ids` after the chain `held`.

        Returns (block id, needs_write) for each block taken, with a reference acquired: blocks
        already cached under the same key are shared (no write), others come from the free
        list (never-hashed first, then least recently used). Stops early when no block can be
        had or on a hash collision; the caller writes the KV of the `needs_write` ones.
        """
        bs = self.block_size
        parent = self.chain_hash(held)
        out: list[tuple[int, bool]] = []
        for j in range(len(held), num_blocks):
            tokens = tuple(token_ids[j * bs:(j + 1) * bs])
            if len(tokens) < bs:
                break
            h = block_hash(parent, tokens, adapter)
            bid = self.hash_to_block.get(h)
            if bid is not None:
                if self.blocks[bid].token_ids != tokens:
                    break  # collision: keep the resident block, stop the chain here
                self.acquire([bid])
                out.append((bid, False))
            else:
                bid = self._take_free()
                if bid is None:
                    break
                block = self.blocks[bid]
                block.hash, block.token_ids, block.ref_count = h, tokens, 1
                self.hash_to_block[h] = bid
                self._index(block, parent, adapter)
                if self.tier is not None:
                    self.tier.stored(bid, h, tokens, adapter)
                out.append((bid, True))
            parent = h
        return out

    def _take_free(self) -> int | None:
        if self.num_free and (not self.free_cached or len(self.free_cached) <= self.max_cached):
            if self.free_unhashed:
                return heapq.heappop(self.free_unhashed)
            self.blocks.append(Block(len(self.blocks)))
            return self.blocks[-1].block_id
        if self.free_cached:
            bid, _ = self.free_cached.popitem(last=False)
            block = self.blocks[bid]
            if self.tier is not None:
                self.tier.evicting(bid, block.hash, block.token_ids)
            self._unkey(block)
            self.evictions += 1
            return bid
        return None

    def drop_cached(self) -> int:
        """Forget every free cached block (new model weights: requests admitted from now on use a new
        key, so these can never be hit again); blocks still held keep their key. Returns how many."""
        dropped = list(self.free_cached)
        for bid in dropped:
            self._unkey(self.blocks[bid])
        self.free_unhashed.extend(dropped)
        heapq.heapify(self.free_unhashed)
        self.free_cached.clear()
        return len(dropped)

    def reset(self) -> None:
        """Forget every cached block (only valid when no sequence holds any)."""
        if self.num_used:
            raise RuntimeError("cannot reset the prefix cache while blocks are referenced")
        tier = self.tier
        self.__init__(self.num_blocks, self.block_size, self.max_cached)
        self.tier = tier
        if tier is not None:
            tier.forget()

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, expected_refs: Mapping[int, int]) -> None:
        """AssertionError unless refs equal `expected_refs` and the free lists and map agree."""
        unhashed = set(self.free_unhashed)
        cached = set(self.free_cached)
        assert len(unhashed) == len(self.free_unhashed), "duplicate in the free list"
        assert not unhashed & cached, "a block is in both free lists"
        assert self.num_free + self.num_cached + self.num_used == self.num_blocks
        for block in self.blocks:
            bid = block.block_id
            want = expected_refs.get(bid, 0)
            assert block.ref_count == want, f"block {bid}: ref_count {block.ref_count}, live sequences hold {want}"
            if block.ref_count == 0:
                if block.hash == NO_HASH:
                    assert bid in unhashed, f"free unhashed block {bid} missing from the free list"
                else:
                    assert bid in cached, f"free cached block {bid} missing from the LRU list"
            else:
                assert bid not in unhashed and bid not in cached, f"used block {bid} is on a free list"
            if block.hash != NO_HASH:
                assert self.hash_to_block.get(block.hash) == bid, f"block {bid}'s hash is not mapped to it"
                assert len(block.token_ids) == self.block_size
            else:
                assert block.token_ids == ()
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, f"hash map entry for block {bid} is stale"
        indexed = {bid for family in self.families.values() for _, bid in family}
        assert indexed == {b.block_id for b in self.blocks if b.family is not None}, "a family lists a block not in it"
        for key, family in self.families.items():
            assert family == sorted(family) and all(self.blocks[bid].family == key and self.blocks[bid].token_ids == t
                                                    for t, bid in family), f"family {key} is stale or unsorted"
        extra = [b for b in expected_refs if not 0 <= b < len(self.blocks)]
        assert not extra, f"sequences hold unknown blocks {sorted(extra)}"


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
