"""Row and block bookkeeping: which sequence holds which row, kept as running rows [0, nrun) then
prefilling rows [pre0, pre0 + npre), and the row ops (plan.py) that keep them so when a sequence
leaves, joins the running rows or moves (they move per-row state only); each sequence's block
table (allocated as it grows, keyed in the prefix cache as blocks fill, released when it leaves).
The Scheduler (the policy) is built on it.

Rows [nrun, pre0) are a gap, free rows left where closing it would move a long prefilling row
(more than `move_limit` computed positions): a short prompt finishing its prefill beside a long one
then moves only its own row to row nrun, and a running row leaving moves nothing. Before the block
store a move copied the row's KV (281 MB for a 6k-token row of the default model, issue 30); here it
copies the row's per-row state only, and the gap keeps the long row's place all the same. The gap is
closed when its rows are needed (rows_in_use counts them)."""

from __future__ import annotations

from .blocks import BlockManager
from .plan import CopyBlocks, CopyRow, InitRow, RowOp
from .sequence import Sequence, Status


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class RowLayout:
    def __init__(self, blocks: BlockManager, block_size: int, prefix_cache: bool = True, move_limit: int = 0) -> None:
        self.blocks = blocks
        self.prefix_cache = prefix_cache  # full blocks are keyed for later hits (else the store only allocates)
        self.block_size = block_size
        self.move_limit = move_limit  # a prefilling row holding more computed positions is not moved to close the gap
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.pre0 = 0  # the prefill region's first row: nrun, or more with a gap
        self.reserved = 0  # rows held for n > 1 followers until their leader's prefill is done
        self.shape = (0, 0)  # live buffer allocation (rows, capacity) as last emitted
        self._pending: list[RowOp] = []

    @property
    def nrun(self) -> int:
        return len(self.running)

    @property
    def gap(self) -> int:
        """Free rows between the running rows and the prefill region."""
        return self.pre0 - self.nrun if self.prefilling else 0

    @property
    def rows_in_use(self) -> int:
        return len(self.running) + len(self.prefilling) + self.reserved + self.gap

    def close_gap(self, limit: int | None = None) -> bool:
        """Move the prefill region's last rows to just before its first (the old layout's compaction)
        while there is a gap, only rows of at most `limit` computed positions (None: any); whether it
        moved any."""
        moved = False
        while self.gap and (limit is None or self.prefilling[-1].num_computed <= limit):
            tail = self.prefilling.pop()
            self.pre0 -= 1
            self._pending.append(CopyRow(tail.row, self.pre0, tail.num_computed))
            self.prefilling.insert(0, tail)
            self._renumber_prefilling()
            moved = True
        return moved

    def take_ops(self) -> list[RowOp]:
        ops, self._pending = self._pending, []
        return ops

    def _release(self, seq: Sequence, *, writeback: bool) -> None:
        group = seq.group
        if group is not None and group.leader is seq and seq.status is not Status.WAITING:
            self.reserved -= len(group.followers)  # the followers never got their rows
        if writeback and seq.row >= 0:
            self._write_back(seq)
        if seq.status is Status.RUNNING:
            self._remove_running(seq)
        elif seq.status is Status.PREFILLING:
            self._remove_prefilling(seq)
        if seq.block_ids:
            self.blocks.release(seq.block_ids)
        seq.block_ids = []
        seq.num_keyed, seq.chain_hash = 0, -1
        seq.row = -1
        seq.inflight = 0

    def _write_back(self, seq: Sequence) -> None:
        """Key the sequence's full computed blocks in the prefix cache: they are in the store already."""
        if not self.prefix_cache or not seq.uses_prefix_cache:
            return
        valid = min(seq.num_computed, seq.num_tokens, len(seq.block_ids) * self.block_size)
        nfull = valid // self.block_size
        if nfull > seq.num_keyed:
            seq.num_keyed, seq.chain_hash = self.blocks.register(seq.block_ids, seq.num_keyed, seq.cache_ids,
                                                                 seq.adapter, seq.chain_hash, nfull)

    def _ensure_blocks(self, seq: Sequence, tokens: int) -> None:
        """Extend the sequence's block table to hold `tokens` positions (the policy made room)."""
        need = blocks_for(tokens, self.block_size) - len(seq.block_ids)
        if need > 0:
            got = self.blocks.allocate(need)
            assert got is not None, f"no {need} free blocks for {tokens} tokens (the policy should have made room)"
            seq.block_ids.extend(got)

    def _remove_running(self, seq: Sequence) -> None:
        r, last = seq.row, self.nrun - 1
        assert self.running[r] is seq
        if r != last:
            moved = self.running[last]
            self._pending.append(CopyRow(last, r, moved.num_computed))
            self.running[r] = moved
            moved.row = r
        self.running.pop()
        self._renumber_prefilling()
        self.close_gap(self.move_limit)  # a long prefilling row stays where it is

    def _remove_prefilling(self, seq: Sequence) -> None:
        j = self.prefilling.index(seq)
        if j == 0 and len(self.prefilling) > 1 and self.prefilling[-1].num_computed > self.move_limit:
            self.prefilling.pop(0)  # the region starts a row later (a gap) instead of moving a long row
            self.pre0 += 1
        else:
            self._fill_from_last(j)
        self._renumber_prefilling()

    def _fill_from_last(self, j: int) -> None:
        """Take prefilling[j] out of the region, the region's last row copied into its row."""
        last = self.prefilling[-1]
        if j != len(self.prefilling) - 1:
            self._pending.append(CopyRow(last.row, self.prefilling[j].row, last.num_computed))
            self.prefilling[j] = last
        self.prefilling.pop()

    def _renumber_prefilling(self) -> None:
        if not self.prefilling or self.pre0 < self.nrun:
            self.pre0 = self.nrun
        for j, s in enumerate(self.prefilling):
            s.row = self.pre0 + j

    def _insert_running(self, seq: Sequence, *, copy_from: Sequence) -> None:
        """Give `seq` the row right after the running ones (moving a prefilling row out of the
        way), fill it from another row, then start its sampling state."""
        if self.prefilling and not self.gap:
            first = self.prefilling.pop(0)
            self._pending.append(CopyRow(first.row, self.nrun + len(self.prefilling) + 1, first.num_computed))
            self.prefilling.append(first)
        seq.row = self.nrun
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._renumber_prefilling()
        self._share_blocks(seq, copy_from)
        self._pending.append(CopyRow(copy_from.row, seq.row, copy_from.num_computed))
        self._pending.append(InitRow(seq.row, seq))

    def _copy_block(self, src: int, dst: int) -> None:
        """Queue block dst := block src, in the same CopyBlocks as the step's other copies."""
        if self._pending and isinstance(self._pending[-1], CopyBlocks):
            self._pending[-1].pairs.append((src, dst))
        else:
            self._pending.append(CopyBlocks([(src, dst)]))

    def _share_blocks(self, seq: Sequence, source: Sequence) -> None:
        """`seq`'s table := `source`'s computed blocks: the full ones shared (a reference each), a
        partly filled last one copied (the two write their next tokens into it)."""
        n = min(source.num_computed, len(source.block_ids) * self.block_size)
        full, part = divmod(n, self.block_size)
        shared = source.block_ids[:full]
        self.blocks.acquire(shared)
        seq.block_ids = list(shared)
        seq.num_keyed, seq.chain_hash = source.num_keyed, source.chain_hash  # only full blocks are keyed
        if part:
            got = self.blocks.allocate(1)
            assert got is not None, "no free block for a fork's last block (the policy should have made room)"
            self._copy_block(source.block_ids[full], got[0])
            seq.block_ids.extend(got)

    def reserve(self, seq: Sequence, tokens: int) -> int:
        """Extend a running sequence's table toward `tokens` positions with the blocks that are free or
        evictable (a speculative verify pass writes past the next token); the positions it holds now."""
        need = min(blocks_for(tokens, self.block_size) - len(seq.block_ids), self.blocks.num_free + self.blocks.num_cached)
        if need > 0:
            got = self.blocks.allocate(need)
            assert got is not None
            seq.block_ids.extend(got)
        return len(seq.block_ids) * self.block_size

    def truncate(self, seq: Sequence, tokens: int) -> None:
        """Release the blocks of a sequence's table past the first `tokens` positions (spec rollback:
        the rejected positions' tail); keyed blocks stay."""
        keep = max(blocks_for(tokens, self.block_size), seq.num_keyed)
        tail = seq.block_ids[keep:]
        if tail:
            self.blocks.release(tail)
            del seq.block_ids[keep:]
