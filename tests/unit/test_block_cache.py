"""The worker-local block cache: exact LRU eviction order, byte budget, longest prefix, events."""

from __future__ import annotations

import torch

from kite_worker.engines.reference.block_cache import BlockCache, CacheEvent

BLOCK = torch.zeros(2, 2, 1, 16, 4, dtype=torch.float16)  # 512 bytes
H = [bytes([i]) * 32 for i in range(6)]
FP = "ab" * 32  # the model fingerprint the blocks belong to
ADAPTER_FP = "cd" * 32


def test_lru_eviction_order_and_events():
    cache = BlockCache(capacity_bytes=3 * 512)
    for h in H[:3]:
        assert cache.put(h, BLOCK, FP)
    cache.get_prefix([H[0]])  # H0 becomes most recently used; H1 is now oldest
    cache.put(H[3], BLOCK, FP)
    assert list(cache.keys()) == [H[2], H[0], H[3]]
    cache.put(H[4], BLOCK, FP)
    assert list(cache.keys()) == [H[0], H[3], H[4]]
    assert cache.take_events() == [CacheEvent("stored", H[0], FP), CacheEvent("stored", H[1], FP),
                                   CacheEvent("stored", H[2], FP), CacheEvent("removed", H[1], FP),
                                   CacheEvent("stored", H[3], FP), CacheEvent("removed", H[2], FP),
                                   CacheEvent("stored", H[4], FP)]
    assert cache.take_events() == [] and cache.num_bytes == 3 * 512 and cache.num_evictions == 2


def test_longest_prefix_stops_at_first_gap_and_duplicates_are_not_stored():
    cache = BlockCache(capacity_bytes=10 * 512)
    for h in (H[0], H[1], H[3]):
        cache.put(h, BLOCK, FP)
    assert cache.longest_prefix([H[0], H[1], H[2], H[3]]) == 2
    assert cache.longest_prefix([H[5], H[0]]) == 0
    assert cache.put(H[0], BLOCK, FP) is False and len(cache) == 3


def test_block_larger_than_budget_is_refused():
    assert BlockCache(capacity_bytes=100).put(H[0], BLOCK, FP) is False


def test_events_name_the_fingerprint_each_block_was_stored_under():
    cache = BlockCache(capacity_bytes=2 * 512)
    cache.put(H[0], BLOCK, FP)
    cache.put(H[1], BLOCK, ADAPTER_FP)
    cache.put(H[2], BLOCK, FP)  # evicts H0
    cache.clear()
    assert cache.take_events() == [CacheEvent("stored", H[0], FP), CacheEvent("stored", H[1], ADAPTER_FP),
                                   CacheEvent("removed", H[0], FP), CacheEvent("stored", H[2], FP),
                                   CacheEvent("removed", H[1], ADAPTER_FP), CacheEvent("removed", H[2], FP)]


def test_drop_model_removes_one_fingerprints_blocks_only():
    cache = BlockCache(capacity_bytes=10 * 512)
    cache.put(H[0], BLOCK, FP)
    cache.put(H[1], BLOCK, ADAPTER_FP)
    cache.put(H[2], BLOCK, FP)
    cache.take_events()
    assert cache.drop_model(FP) == 2
    assert list(cache.keys()) == [H[1]] and cache.num_bytes == 512
    assert cache.take_events() == [CacheEvent("removed", H[0], FP), CacheEvent("removed", H[2], FP)]
    assert cache.drop_model(FP) == 0
