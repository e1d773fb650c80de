"""Paged KV cache: allocation, append, O(1) rollback, free, capacity accounting."""
import pytest

from speculant.engine.kv_cache import CacheFullError, KVCache


def make_cache(num_blocks=4, block_size=4):
    return KVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size)


def test_reserve_allocates_whole_blocks_and_slots_follow_the_table():
    cache = make_cache()
    cache.allocate(7)
    cache.reserve(7, 6)  # 6 tokens -> 2 blocks of 4
    assert len(cache.block_table(7)) == 2
    assert cache.num_free_blocks == 2
    table = cache.block_table(7)
    assert cache.slots(7, 3, 2) == [table[0] * 4 + 3, table[1] * 4 + 0]


def test_truncate_is_rollback_and_returns_unused_blocks():
    cache = make_cache()
    cache.allocate(0)
    cache.reserve(0, 9)
    cache.set_length(0, 9)
    cache.truncate(0, 4)  # back to exactly one full block
    assert cache.length(0) == 4
    assert len(cache.block_table(0)) == 1
    assert cache.num_free_blocks == 3


def test_truncate_cannot_grow_and_set_length_cannot_exceed_reservation():
    cache = make_cache()
    cache.allocate(0)
    cache.reserve(0, 4)
    cache.set_length(0, 3)
    with pytest.raises(ValueError):
        cache.truncate(0, 5)
    with pytest.raises(ValueError):
        cache.set_length(0, 5)


def test_cache_full_raises_and_leaves_other_sequences_untouched():
    cache = make_cache(num_blocks=2)
    cache.allocate(0)
    cache.reserve(0, 8)
    cache.allocate(1)
    with pytest.raises(CacheFullError):
        cache.reserve(1, 1)
    assert len(cache.block_table(0)) == 2
    assert not cache.can_grow(1, 1)


def test_free_returns_every_block_and_allows_reallocation():
    cache = make_cache()
    cache.allocate(0)
    cache.reserve(0, 16)
    cache.free(0)
    assert cache.num_free_blocks == 4
    assert not cache.has(0)
    cache.allocate(0)  # the id can be reused after free
    cache.free(99)  # freeing an unknown id is a no-op


def test_misuse_names_the_sequence():
    cache = make_cache()
    with pytest.raises(KeyError, match="sequence 5"):
        cache.length(5)
    cache.allocate(5)
    with pytest.raises(ValueError, match="sequence 5"):
        cache.allocate(5)


def test_trim_reservation_keeps_committed_blocks_only():
    cache = make_cache()
    cache.allocate(0)
    cache.reserve(0, 12)  # room for a draft
    cache.set_length(0, 5)
    cache.trim_reservation(0)
    assert len(cache.block_table(0)) == 2
