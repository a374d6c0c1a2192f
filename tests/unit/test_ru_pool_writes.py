"""ru-pool writes (kite_ru_pool.writes) over the pool's parts: admission (dedupe), the hot tier kept in
step with the index (demotion of what it evicts, pinned blocks, unfit puts) and a failed demotion. Quota
evictions: test_ru_pool_tenants.py; the background writes over real tiers:
tests/integration/test_ru_pool_{service,tiers,tier_codecs}.py."""

from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, HOT, WARM
from kite_ru_pool.lifecycle import Demote
from kite_shared.tiers.keys import BlockKey

FP = "33" * 32
CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks


def key(i: int) -> BlockKey:
    return BlockKey.of(FP, bytes([i]) * 32)


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=30, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=5.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def test_put_dedupes_identical_blocks():
    c = core(hot_bytes=1 << 20)
    key = BlockKey.of(FP, CHAIN[0])
    assert c.writes.admit_put(key) == "store"
    c.writes.put_hot(key, b"x" * 100, now=1.0)
    assert c.writes.admit_put(key) == "duplicate"
    assert (c.counters.puts, c.counters.duplicates) == (1, 1)


def test_hot_eviction_demotes_to_warm_only_blocks_no_slower_tier_holds():
    c = core()
    c.writes.put_hot(key(1), b"a" * 10, now=1.0)
    c.writes.put_hot(key(2), b"b" * 10, now=2.0)
    c.writes.put_hot(key(3), b"c" * 10, now=3.0)
    c.index.note_stored(key(2), WARM, 10, now=3.5)  # write-through of 2 finished, 1's did not
    assert c.writes.put_hot(key(4), b"d" * 10, now=4.0) == [Demote(key(1), b"a" * 10, WARM)]
    assert c.writes.put_hot(key(5), b"e" * 10, now=5.0) == []  # evicts 2, which warm already holds
    assert c.index.tiers_of(key(2)) == WARM
    assert c.index.tiers_of(key(1)) == 0  # pending demotion: invisible to lookups until it reports
    assert c.reads.lookup(FP, [key(1).block_hash]).pool == 0
    assert c.counters.hot_evictions == 2


def test_demotion_goes_to_cold_when_warm_is_down_or_off():
    c = core(has_warm=False)
    c.writes.put_hot(key(1), b"a" * 20, now=1.0)
    assert c.writes.put_hot(key(2), b"b" * 20, now=2.0) == [Demote(key(1), b"a" * 20, COLD)]
    c.writes.demotion_failed(key(1))
    assert c.index.entry(key(1)) is None
    assert c.counters.demotions_failed == 1


def test_pinned_hot_blocks_stay_and_unfit_puts_are_refused():
    c = core()
    c.catalog.pin(FP, [key(1).block_hash, key(2).block_hash, key(3).block_hash])
    for i in (1, 2, 3):
        c.writes.put_hot(key(i), bytes([i]) * 10, now=float(i))
    assert c.writes.put_hot(key(4), b"d" * 10, now=4.0) == []
    assert c.counters.hot_refused == 1 and c.index.tiers_of(key(4)) == 0
    assert all(c.index.tiers_of(key(i)) == HOT for i in (1, 2, 3))


def test_units_a_worker_wrote_to_warm_are_admitted_like_puts_and_indexed_in_warm():
    c = core(hot_bytes=1 << 20)
    c.writes.put_hot(key(1), b"a" * 10, now=1.0)  # hot already holds block 1
    decisions = c.writes.units_written([key(1), key(2), key(2)], sizes=[10, 20, 20], depths=[0, 1, 1])
    assert decisions == ["duplicate", "store", "duplicate"]
    assert (c.index.tiers_of(key(1)), c.index.tiers_of(key(2))) == (HOT | WARM, WARM)
    assert c.index.entry(key(2)).depth == 1 and c.index.entry(key(2)).size == 20
    assert (c.counters.puts, c.counters.duplicates) == (1, 2)  # block 2 stored; 1, then 2 again, duplicates
    assert c.reads.lookup(FP, [key(1).block_hash, key(2).block_hash]).tiers == b"hw"


def test_units_written_for_an_invalidated_model_are_refused():
    c = core()
    c.catalog.model_fingerprint_changed("m", FP)
    c.catalog.model_fingerprint_changed("m", "44" * 32)
    assert c.writes.units_written([key(1)], sizes=[10], depths=[0]) == ["invalidated"]
    assert c.index.entry(key(1)) is None and c.counters.refused_invalidated == 1
