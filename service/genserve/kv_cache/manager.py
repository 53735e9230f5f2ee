"""The only KV-cache API the scheduler sees: which blocks a request owns, what it can reuse.

A request's block table is a list of blocks covering positions ``0 .. n - 1`` in order.  The
manager allocates exactly what a step needs (no reservation for future tokens), hands out
prefix-cache hits, registers newly computed full blocks in the prefix cache, and frees.

Sharing rule: only full, hashed blocks are ever shared, and a request only writes positions at
or after its ``num_computed_tokens``, which never lies inside a reused block; so a shared block
is never written.  That is also why a cache hit always leaves the last token of the sequence
to compute: its logits are needed, and its position may sit in the last full block.

The manager never sees the engine's request type: it reads a sequence through
:class:`KVSequence`, the few fields it needs (the engine's ``Request`` has them).

Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from genserve.kv_cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens


class _PromptLogprobs(Protocol):
    @property
    def prompt_logprobs(self) -> bool:
        """True: every prompt position's logits are wanted, so no prefix may be reused."""
        ...


class KVSequence(Protocol):
    """What the manager reads of a sequence it holds blocks for."""

    @property
    def req_id(self) -> str: ...

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens, in order: what the block hashes cover."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int:
        """Leading tokens whose KV is written (blocks up to there may be cached)."""
        ...

    @property
    def cache_salt(self) -> str | None:
        """Mixed into every block hash: sequences with different salts never share KV."""
        ...

    @property
    def sampling(self) -> _PromptLogprobs: ...


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int  # free but still holding a reusable prefix
    usage: float  # used / total, in [0, 1]
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found


class KVCacheManager:
    """Blocks per request on top of a :class:`BlockPool`.

    ``enable_prefix_caching=False`` turns off both lookups and hashing (every block is plain).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # block_ids() of each request, kept until its table changes: a running request's
        # table is read every step (its chunk) but changes once a block_size tokens.
        self._req_block_ids: dict[str, tuple[int, ...]] = {}
        # Hashes of the full blocks of a request's token sequence, extended lazily; they depend
        # only on tokens, which never change once a block is full.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the request's table are known to the hash map already
        # (cached by this request, reused from the cache, or found to be duplicates).
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # (req_id, queried tokens, hit tokens) of the last lookup, counted once the request's
        # allocation succeeds: a request retried every step while it waits counts once.
        self._pending_lookup: tuple[str, int, int] | None = None

    # ---- capacity -------------------------------------------------------------------------

    @property
    def max_num_tokens(self) -> int:
        """Positions the whole pool can hold: the most KV one request can ever own."""
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_cached_free_blocks=self.pool.num_cached_free_blocks,
            usage=self.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    # ---- prefix cache ---------------------------------------------------------------------

    def _block_hashes(self, req: KVSequence, num_blocks: int) -> list[BlockHash]:
        """The request's block hashes, computed up to ``num_blocks`` full blocks."""
        hashes = self._req_hashes.setdefault(req.req_id, [])
        if len(hashes) < num_blocks:
            token_ids = req.all_token_ids
            extra_keys = (req.cache_salt,) if req.cache_salt is not None else ()
            bs = self.block_size
            for i in range(len(hashes), num_blocks):
                parent = hashes[i - 1] if i else None
                hashes.append(
                    hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra_keys)
                )
        return hashes

    def _lookup(self, req: KVSequence) -> list[KVBlock]:
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs:
            return []
        # num_tokens - 1: the last token is always computed, for its logits.
        num_full = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(req, num_full):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def get_computed_blocks(self, req: KVSequence) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of ``req``'s sequence: ``(blocks, num_computed_tokens)``.

        For a request that owns no blocks yet.  Leaves at least the last token to compute;
        returns ``([], 0)`` when prefix caching is off or the request wants prompt logprobs
        (those need every position computed).  The blocks are only valid until the next
        allocation: pass them straight to :meth:`allocate_slots`.  The lookup counts towards
        the prefix-cache statistics when that allocation succeeds.
        """
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs:
            return [], 0
        hits = self._lookup(req)
        num_computed = len(hits) * self.block_size
        self._pending_lookup = (req.req_id, req.num_tokens, num_computed)
        return hits, num_computed

    def peek_num_cached_tokens(self, req: KVSequence) -> int:
        """Like :meth:`get_computed_blocks` but only the token count and without statistics
        (for ordering the waiting queue)."""
        return len(self._lookup(req)) * self.block_size

    def cache_blocks(self, req: KVSequence) -> None:
        """Register the request's full blocks whose KV is computed (below
        ``req.num_computed_tokens``) in the prefix cache.  Call after each step's results."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks.get(req.req_id)
        if not blocks:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(req.req_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req.req_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after the weights changed)."""
        self.pool.reset_prefix_cache()
        for req_id, blocks in self._req_blocks.items():
            # Blocks computed before the reset are never registered again: a reset may mean
            # their KV is stale (new weights).
            self._num_cached_blocks[req_id] = len(blocks)

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        req: KVSequence,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_reserved_blocks: int = 0,
    ) -> list[KVBlock] | None:
        """Make ``req``'s block table cover its computed tokens, ``new_computed_blocks``
        (prefix-cache hits from :meth:`get_computed_blocks`, appended first) and
        ``num_new_tokens`` more positions.

        ``req.num_computed_tokens`` must not yet include the hits; the caller adds them after
        success.  Returns the newly taken blocks, or None (changing nothing) when fewer than
        the needed blocks plus ``num_reserved_blocks`` are free: the caller preempts or waits.
        """
        blocks = self._req_blocks.get(req.req_id, [])
        if blocks and not new_computed_blocks and self._pending_lookup is None:
            # A decode step's usual case, once per running request a step (the engine
            # thread's hot path): the table already covers the new positions.
            num_tokens = req.num_computed_tokens + num_new_tokens
            if -(-num_tokens // self.block_size) <= len(blocks) and (
                num_reserved_blocks <= 0 or num_reserved_blocks <= self.pool.num_free_blocks
            ):
                return []
        if new_computed_blocks and blocks:
            raise ValueError(f"{req.req_id}: prefix hits are only for a request without blocks")
        num_tokens = (
            req.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        )
        num_needed = self.num_blocks_for(num_tokens) - len(blocks) - len(new_computed_blocks)
        # Reusing a free cached block takes it off the free list too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + num_revived + num_reserved_blocks > self.pool.num_free_blocks:
            return None
        pending, self._pending_lookup = self._pending_lookup, None
        if pending is not None and pending[0] == req.req_id:
            self.prefix_cache_queries += pending[1]
            self.prefix_cache_hits += pending[2]
        if new_computed_blocks or num_needed > 0:
            self._req_block_ids.pop(req.req_id, None)
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks = self._req_blocks.setdefault(req.req_id, [])
            blocks.extend(new_computed_blocks)
            self._num_cached_blocks[req.req_id] = len(new_computed_blocks)
        if num_needed <= 0:  # the decode step's usual case: the table has room
            self._req_blocks.setdefault(req.req_id, [])
            return []
        new_blocks = self.pool.take_new_blocks(num_needed)
        self._req_blocks.setdefault(req.req_id, []).extend(new_blocks)
        return new_blocks

    def free(self, req: KVSequence, *, keep_block_hashes: bool = False) -> None:
        """Return all of ``req``'s blocks.  Full computed blocks stay hashed on the LRU free
        list (tail blocks are evicted first).  ``keep_block_hashes`` keeps the request's
        token hashes for a later lookup (preemption); otherwise everything about the request
        is forgotten.  Idempotent."""
        blocks = self._req_blocks.pop(req.req_id, None)
        self._req_block_ids.pop(req.req_id, None)
        self._num_cached_blocks.pop(req.req_id, None)
        if not keep_block_hashes:
            self._req_hashes.pop(req.req_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def block_ids(self, req_id: str) -> tuple[int, ...]:
        """The request's block table (block ids in position order)."""
        ids = self._req_block_ids.get(req_id)
        if ids is None:
            blocks = self._req_blocks.get(req_id)
            ids = tuple(b.block_id for b in blocks) if blocks else ()
            if blocks is not None:
                self._req_block_ids[req_id] = ids
        return ids

    def owned_blocks(self, req_id: str) -> list[KVBlock]:
        """The request's block table (a copy); see engine/prompt_fork.py."""
        return list(self._req_blocks.get(req_id, ()))

    def num_owned_blocks(self, req_id: str) -> int:
        return len(self._req_blocks.get(req_id, ()))

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` unless every block's ``ref_cnt`` equals the number of block
        tables holding it, no table holds a block twice, every remembered :meth:`block_ids`
        is its table's, and the pool is consistent."""
        self.pool.check_invariants()
        owners = [0] * self.num_blocks
        for req_id, blocks in self._req_blocks.items():
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids):
                raise RuntimeError(f"{req_id} holds a block twice: {ids}")
            remembered = self._req_block_ids.get(req_id)
            if remembered is not None and list(remembered) != ids:
                raise RuntimeError(f"{req_id}: block_ids {remembered} but the table is {ids}")
            for block_id in ids:
                owners[block_id] += 1
        if not self._req_block_ids.keys() <= self._req_blocks.keys():
            raise RuntimeError("block_ids remembered for a request without a table")
        for block in self.pool.blocks:
            if block.ref_cnt != owners[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                    f"{owners[block.block_id]} owners"
                )
