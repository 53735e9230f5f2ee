"""BlockPool: hashing, ref counts, free lists, LRU eviction (pure Python, no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from genserve.kv_cache.block_pool import BlockPool, hash_block_tokens


def test_hash_is_chained_salted_and_content_sensitive() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    assert first != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(None, [1], ("a",)) != hash_block_tokens(None, [1], ("b",))
    # Same block content under different parents: different prefixes, different hashes.
    parent_a = hash_block_tokens(None, [9, 9, 9, 9])
    parent_b = hash_block_tokens(None, [8, 8, 8, 8])
    assert hash_block_tokens(parent_a, [1, 2, 3, 4]) != hash_block_tokens(parent_b, [1, 2, 3, 4])
    assert hash_block_tokens(parent_a, [1, 2, 3, 4]) != first
    # Length-prefixing keeps token/key boundaries unambiguous.
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    # Large token ids (beyond 32 bits) are hashed, not truncated.
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_take_and_free_track_ref_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.take_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.take_new_blocks(2)
    assert pool.num_free_blocks == 1  # a failed take changes nothing
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([blocks[0]])
    pool.check_invariants()


def test_shared_block_is_free_only_after_last_owner() -> None:
    pool = BlockPool(2)
    (block,) = pool.take_new_blocks(1)
    assert pool.cache_block(block, b"h")
    pool.touch([block])  # a second request reuses it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1 and block.ref_cnt == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    # Freed but still cached: found by hash, revived by touch.
    assert pool.get_cached_block(b"h") is block
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.check_invariants()


def test_cached_blocks_evicted_in_lru_order_after_plain_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.take_new_blocks(4)
    for i, block in enumerate(blocks[:3]):
        assert pool.cache_block(block, bytes([i]))
    # Freed in this order: 2, 0, 3 (unhashed), 1.
    for i in (2, 0, 3, 1):
        pool.free_blocks([blocks[i]])
    assert pool.num_cached_free_blocks == 3
    # The unhashed block goes first, then cached blocks least recently freed first.
    order = [pool.take_new_blocks(1)[0].block_id for _ in range(4)]
    assert order == [3, 2, 0, 1]
    # Eviction dropped the hashes.
    assert all(pool.get_cached_block(bytes([i])) is None for i in range(3))
    assert all(b.block_hash is None for b in blocks)
    pool.check_invariants()


def test_reviving_a_cached_block_refreshes_its_lru_position() -> None:
    pool = BlockPool(3)
    blocks = pool.take_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]))
    pool.free_blocks(blocks)  # LRU order 0, 1, 2
    pool.touch([blocks[0]])
    pool.free_blocks([blocks[0]])  # now 1, 2, 0
    assert [pool.take_new_blocks(1)[0].block_id for _ in range(3)] == [1, 2, 0]


def test_duplicate_content_stays_unhashed() -> None:
    pool = BlockPool(2)
    a, b = pool.take_new_blocks(2)
    assert pool.cache_block(a, b"same")
    assert not pool.cache_block(b, b"same")
    assert b.block_hash is None and pool.get_cached_block(b"same") is a
    pool.free_blocks([a, b])
    with pytest.raises(ValueError, match="not owned"):
        pool.cache_block(a, b"other")
    pool.check_invariants()


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(3)
    a, b, c = pool.take_new_blocks(3)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"a") is None and pool.get_cached_block(b"b") is None
    assert pool.num_cached_free_blocks == 0 and pool.num_free_blocks == 1
    assert b.block_hash is None
    pool.free_blocks([b, c])
    pool.check_invariants()


def test_kv_and_scheduler_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import genserve.kv_cache.block_pool, genserve.kv_cache.manager\n"
        "import genserve.engine.scheduler, genserve.engine.scheduler_config\n"
        "import genserve.engine.scheduler_policy, genserve.engine.scheduler_output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'numpy' not in sys.modules, 'numpy was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
