"""Hot tier LRU: eviction order, byte budget, pins, event draining."""

import pytest

from kite_shared.tiers.hot import Eviction, HotLRU
from kite_shared.tiers.keys import BlockKey


def k(i: int) -> BlockKey:
    return BlockKey("0123456789abcdef", bytes([i]) * 32)


def test_evicts_least_recently_used_first_and_reports_events_once():
    lru = HotLRU(30)
    for i in (1, 2, 3):
        assert lru.put(k(i), bytes([i]) * 10)
    assert lru.get(k(1)) == b"\x01" * 10  # 1 becomes most recent: order 2, 3, 1
    assert lru.put(k(4), b"\x04" * 10)
    assert lru.take_events() == [Eviction(k(2), b"\x02" * 10)]
    assert lru.take_events() == []
    assert lru.put(k(5), b"\x05" * 20)  # needs two slots: 3 then 1
    assert [e.key for e in lru.take_events()] == [k(3), k(1)]
    assert list(lru.keys()) == [k(4), k(5)]
    assert lru.bytes_used == 30


def test_peek_does_not_refresh_recency():
    lru = HotLRU(20)
    lru.put(k(1), b"a" * 10)
    lru.put(k(2), b"b" * 10)
    assert lru.peek(k(1)) == b"a" * 10
    lru.put(k(3), b"c" * 10)
    assert [e.key for e in lru.take_events()] == [k(1)]


def test_replacing_a_key_adjusts_bytes_without_evicting_itself():
    lru = HotLRU(30)
    lru.put(k(1), b"a" * 10)
    lru.put(k(2), b"b" * 10)
    assert lru.put(k(1), b"A" * 20)
    assert lru.bytes_used == 30 and lru.take_events() == []
    assert lru.get(k(1)) == b"A" * 20


def test_oversize_and_zero_budget_are_refused():
    assert not HotLRU(0).put(k(1), b"x")
    lru = HotLRU(10)
    lru.put(k(1), b"a" * 5)
    assert not lru.put(k(2), b"b" * 11)
    assert lru.take_events() == [] and lru.contains(k(1)) and not lru.contains(k(2))


def test_pinned_entries_are_never_evicted_and_a_put_that_cannot_fit_is_refused():
    lru = HotLRU(20)
    lru.pin(k(1))  # pin before the block arrives
    lru.put(k(1), b"a" * 10)
    lru.put(k(2), b"b" * 10)  # order: 1 (least recent, pinned), 2
    assert lru.put(k(3), b"c" * 10)
    assert [e.key for e in lru.take_events()] == [k(2)]
    lru.pin(k(3))
    assert not lru.put(k(4), b"d" * 10)  # only pinned entries left
    assert lru.take_events() == []
    lru.unpin(k(1))
    assert lru.put(k(4), b"d" * 10)
    assert [e.key for e in lru.take_events()] == [k(1)]


def test_delete_and_clear_are_not_evictions():
    lru = HotLRU(100)
    other = BlockKey("fedcba9876543210", b"\x09" * 32)
    lru.put(k(1), b"a")
    lru.put(k(2), b"b")
    lru.put(other, b"c")
    assert lru.delete(k(1)) and not lru.delete(k(1))
    assert lru.clear("0123456789abcdef") == 1
    assert list(lru.keys()) == [other] and lru.bytes_used == 1
    assert lru.take_events() == []


def test_swap_replaces_only_the_very_bytes_held_and_keeps_recency():
    lru = HotLRU(30)
    old = bytes(b"\x01" * 10)
    lru.put(k(1), old)
    lru.put(k(2), b"\x02" * 10)
    moved = memoryview(bytearray(b"\x01" * 10))  # the same unit, now in another buffer (a hot file)
    assert lru.swap(k(1), old, moved) and lru.peek(k(1)) is moved
    assert not lru.swap(k(1), old, moved)  # the bytes it was asked to replace are gone already
    assert not lru.swap(k(3), old, moved)  # nothing held under that key
    lru.put(k(3), b"\x03" * 10)
    lru.put(k(4), b"\x04" * 10)  # evicts the least recently used: k(1), whose recency the swap kept
    assert [e.key for e in lru.take_events()] == [k(1)] and lru.bytes_used == 30
    with pytest.raises(ValueError):
        lru.swap(k(2), lru.peek(k(2)), b"\x02" * 11)
