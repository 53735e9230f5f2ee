"""KVCacheManager: allocation, prefix hits, caching after steps, freeing (no torch)."""

from __future__ import annotations

from genserve.engine.request import Request, StoppingCriteria
from genserve.kv_cache.manager import KVCacheManager
from genserve.step import SamplingParams

BS = 4


def make_req(
    req_id: str,
    prompt: list[int],
    *,
    salt: str | None = None,
    prompt_logprobs: bool = False,
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(prompt_logprobs=prompt_logprobs),
        stopping=StoppingCriteria(max_new_tokens=16),
        cache_salt=salt,
    )


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """What the scheduler does for a chunk: allocate, (runner computes), advance, cache."""
    assert kv.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens
    kv.cache_blocks(req)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit with prefix reuse and compute the rest of the sequence; returns the hit."""
    blocks, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return num_cached


def test_allocates_exactly_the_blocks_a_step_needs() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_req("a", list(range(10)))
    new = kv.allocate_slots(req, 5)
    assert new is not None and len(new) == 2
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3) == []  # positions 5..7 fit in block 1
    req.num_computed_tokens = 8
    new = kv.allocate_slots(req, 2)
    assert new is not None and len(new) == 1
    assert kv.block_ids("a") == (0, 1, 2)
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 5
    assert kv.usage == 3 / 8
    kv.check_invariants()


def test_allocation_is_all_or_nothing_and_respects_reserve() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = make_req("a", [1] * 12), make_req("b", [2] * 12)
    assert kv.allocate_slots(a, 12) is not None
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert kv.block_ids("b") == () and kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4, num_reserved_blocks=1) is None
    assert kv.allocate_slots(b, 4) is not None
    kv.check_invariants()


def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_req("a", list(range(12)))
    assert admit(kv, first) == 0
    kv.free(first)
    # Same 12 tokens: all 3 blocks cached, but the last token must be computed, so only the
    # first 2 blocks (8 tokens) are reused.
    again = make_req("b", list(range(12)))
    assert admit(kv, again) == 8
    # A longer sequence sharing the prefix reuses all 3 blocks.
    longer = make_req("c", [*range(12), 99, 98])
    assert admit(kv, longer) == 12
    assert kv.block_ids("c")[:2] == kv.block_ids("b")[:2]
    shared = set(kv.block_ids("b")[:2])
    for block in kv.pool.blocks:
        if block.block_id in shared:
            assert block.ref_cnt == 2
    # A shared block sits wholly before both requests' computed positions: never written.
    for req in (again, longer):
        assert req.num_computed_tokens >= 2 * BS
    stats = kv.stats()
    assert stats.prefix_cache_queries == 12 + 12 + 14
    assert stats.prefix_cache_hits == 8 + 12
    kv.check_invariants()


def test_divergent_prefix_stops_the_hit_at_the_first_different_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_req("a", list(range(16))))
    # Block 1 differs; block 2 equals the cached block 2 in content but not in prefix.
    other = make_req("b", [0, 1, 2, 3, 0, 0, 0, 0, 8, 9, 10, 11, 12])
    assert admit(kv, other) == 4


def test_salt_separates_identical_prompts() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_req("a", list(range(9)), salt="tenant-1"))
    assert admit(kv, make_req("b", list(range(9)), salt="tenant-2")) == 0
    assert admit(kv, make_req("c", list(range(9)))) == 0
    assert admit(kv, make_req("d", list(range(9)), salt="tenant-1")) == 8


def test_prompt_logprobs_and_disabled_cache_bypass_lookups() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_req("a", list(range(9))))
    assert kv.get_computed_blocks(make_req("b", list(range(9)), prompt_logprobs=True)) == ([], 0)
    assert kv.peek_num_cached_tokens(make_req("c", list(range(9)))) == 8

    off = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    admit(off, make_req("a", list(range(9))))
    assert off.pool.num_hashed_blocks == 0
    assert off.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)
    assert off.stats().prefix_cache_queries == 0


def test_only_computed_full_blocks_are_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    req = make_req("a", list(range(10)))
    assert kv.allocate_slots(req, 10) is not None
    kv.cache_blocks(req)  # nothing computed yet
    assert kv.pool.num_hashed_blocks == 0
    req.num_computed_tokens = 6
    kv.cache_blocks(req)
    assert kv.pool.num_hashed_blocks == 1
    req.num_computed_tokens = 10
    kv.cache_blocks(req)
    assert kv.pool.num_hashed_blocks == 2  # the third block holds 2 of 4 positions


def test_free_puts_tail_blocks_first_in_line_for_eviction() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(16)))
    compute(kv, a, 16)
    assert kv.pool.num_hashed_blocks == 4
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_free_blocks == 4
    # New data takes the tail of "a" first: its prefix stays reusable longest.
    b = make_req("b", [7] * 4)
    compute(kv, b, 4)
    assert kv.block_ids("b") == (3,)
    assert admit(kv, make_req("c", list(range(12)))) == 8


def test_cached_free_blocks_count_against_revival() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_req("a", list(range(8)))
    compute(kv, a, 8)
    kv.free(a)
    filler = make_req("f", [5] * 4)
    compute(kv, filler, 4)  # takes the plain block; the 2 cached blocks stay free
    b = make_req("b", [*range(8), 1])
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8 and len(blocks) == 2
    # Reviving 2 cached free blocks and taking 1 new block needs 3 free blocks; 2 are free.
    assert kv.allocate_slots(b, 1, blocks) is None
    assert kv.block_ids("b") == () and all(blk.ref_cnt == 0 for blk in blocks)
    kv.free(filler)
    assert kv.allocate_slots(b, 1, blocks) is not None
    kv.check_invariants()


def test_preempted_request_keeps_its_hashes_and_finds_its_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_req("a", list(range(10)))
    compute(kv, req, 10)
    req.output_token_ids.extend([40, 41, 42])
    compute(kv, req, 2)  # decode steps: 12 computed, 13 tokens
    kv.free(req, keep_block_hashes=True)
    req.num_computed_tokens = 0
    blocks, num_cached = kv.get_computed_blocks(req)
    assert num_cached == 12 and len(blocks) == 3


def test_reset_prefix_cache_and_free_everything() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", list(range(9)))
    admit(kv, a)
    kv.reset_prefix_cache()
    assert admit(kv, make_req("b", list(range(9)))) == 0
    kv.free(a)
    kv.free(a)  # idempotent
    kv.free(make_req("b", []))
    assert kv.num_free_blocks == 8
    kv.check_invariants()
