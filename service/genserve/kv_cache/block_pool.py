"""The pool of KV blocks: reference counts, the free lists, and the prefix-cache hash map.

A block holds the KV of ``block_size`` consecutive positions of one sequence.  A *full* block
whose KV has been computed may be given a :data:`BlockHash` that identifies its content
together with everything before it (see :func:`hash_block_tokens`); hashed blocks can be
shared by several requests, which is safe because a full block is never written again.

Freed blocks are not wiped: a hashed block with no owner stays in the hash map on an LRU free
list, so the free list doubles as the prefix cache.  A cached block is evicted (its hash
dropped) only when it is taken for new data.  Unhashed free blocks carry nothing reusable and
are always handed out before any cached block is evicted.

Pure Python; no torch.  Not thread-safe: one owner (the scheduler) drives it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# sha256 digest of (parent hash, token ids, extra keys).  A cryptographic hash rather than
# Python's hash(): a collision would silently serve another prompt's KV.
BlockHash = bytes

_NO_PARENT = b""


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """Hash of one full block: chained through ``parent`` (None for the first block of a
    sequence), so equal hashes mean equal token prefixes, not just equal blocks; ``extra_keys``
    (cache salt, adapter id, ...) separate otherwise identical content."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else _NO_PARENT)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        encoded = key.encode()
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    return h.digest()


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of the pool.  ``ref_cnt`` counts the requests whose block table holds it."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """``num_blocks`` blocks with ids ``0 .. num_blocks - 1``.

    Invariants: every block is either owned (``ref_cnt > 0``) or on exactly one free list;
    a hashed block is the one block the hash map gives for its hash.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        # Unhashed free blocks; popped from the end, so fresh pools hand out low ids first.
        self._free_plain: list[KVBlock] = list(reversed(self.blocks))
        # Hashed free blocks, least recently freed first (the eviction order).
        self._free_cached: OrderedDict[int, KVBlock] = OrderedDict()
        self._hash_to_block: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be taken for new data (cached free blocks included)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def num_hashed_blocks(self) -> int:
        return len(self._hash_to_block)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding the KV for ``block_hash``, owned or free, if any."""
        return self._hash_to_block.get(block_hash)

    def take_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks for new data, each with ``ref_cnt == 1`` and no hash.

        Unhashed free blocks go first, then cached blocks in LRU order (their hashes are
        dropped: that is the eviction).  Raises ``ValueError`` if the pool is short; callers
        check :attr:`num_free_blocks` first.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        taken: list[KVBlock] = []
        while len(taken) < num_blocks and self._free_plain:
            taken.append(self._free_plain.pop())
        while len(taken) < num_blocks:
            _, block = self._free_cached.popitem(last=False)
            assert block.block_hash is not None
            del self._hash_to_block[block.block_hash]
            block.block_hash = None
            taken.append(block)
        for block in taken:
            block.ref_cnt = 1
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one owner to each (hashed) block, taking it off the free list if it was free."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner from each block, in the given order.  Blocks left without owner
        join the free lists; hashed ones at the LRU tail, so pass the blocks that should be
        evicted first (the tail of a sequence) first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_plain.append(block)
                else:
                    self._free_cached[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register an owned, full, computed block under ``block_hash``.

        Returns False (and leaves the block unhashed) when another block already holds this
        content, e.g. two requests that computed the same prefix concurrently.
        """
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block.block_id} is not owned; only owned blocks are cached")
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash.  Owned blocks keep their data but can no longer be shared."""
        for block in self._hash_to_block.values():
            block.block_hash = None
        self._hash_to_block.clear()
        self._free_plain.extend(self._free_cached.values())
        self._free_cached.clear()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the bookkeeping is inconsistent (tests, debugging)."""
        plain = {b.block_id for b in self._free_plain}
        cached = set(self._free_cached)
        if len(plain) != len(self._free_plain) or plain & cached:
            raise RuntimeError("a block is on the free lists twice")
        num_hashed = 0
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in plain or block.block_id in cached):
                raise RuntimeError(f"block {block.block_id}: free-list membership is wrong")
            if block.block_id in plain and block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} is hashed on the plain free list")
            if block.block_id in cached and block.block_hash is None:
                raise RuntimeError(f"block {block.block_id} is unhashed on the cached free list")
            if block.block_hash is not None:
                num_hashed += 1
                if self._hash_to_block.get(block.block_hash) is not block:
                    raise RuntimeError(f"block {block.block_id} is not its hash's block")
        if num_hashed != len(self._hash_to_block):
            raise RuntimeError("the hash map holds blocks that have no hash")
