"""ru-pool lifecycle decisions (kite_ru_pool.lifecycle, through Maintenance.sweep): archival, lease
renewal, cold TTL, pins, hits (exact order). Demotion of what hot evicts: test_ru_pool_writes.py; clears:
test_ru_pool_catalog.py; the sweep walked in slices: test_ru_pool_sweep.py."""

from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, WARM
from kite_ru_pool.lifecycle import Archive, ExpireCold, RenewWarm
from kite_shared.tiers.keys import BlockKey

FP = "33" * 32


def key(i: int) -> BlockKey:
    return BlockKey.of(FP, bytes([i]) * 32)


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=30, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=5.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def test_sweep_archives_idle_warm_blocks_renews_leases_and_expires_cold_oldest_first():
    c = core()
    # last hits: 5 -> t=10, 6 -> t=20, 7 -> t=50, 8 -> t=880 (cold only), 9 -> t=500 (cold only)
    c.index.note_stored(key(6), WARM, 10, now=20.0)
    c.index.note_stored(key(5), WARM | COLD, 10, now=10.0)
    c.index.note_stored(key(7), WARM, 10, now=50.0)
    c.index.note_stored(key(8), COLD, 10, now=880.0)
    c.index.note_stored(key(9), COLD, 10, now=500.0)
    # at t=121: 5 and 6 idle >= 100 -> archive; 7 idle 71 but its lease (60 s, renewed 15 s early)
    # is due -> renew; 9 idle 1000 (not yet: 621); nothing expires
    assert c.maintenance.sweep(now=121.0, warm_up=True, cold_up=True) == [
        Archive(key(5), cold_has_it=True), Archive(key(6), cold_has_it=False), RenewWarm(key(7))]
    # cold TTL: 9 idle 1000 at t=1500, 8 idle 620
    c.index.note_missing(key(5), WARM)
    c.index.note_missing(key(6), WARM)
    c.index.note_stored(key(6), COLD, 10, now=121.0)
    c.index.note_missing(key(7), WARM)
    assert c.maintenance.sweep(now=1500.0, warm_up=True, cold_up=True) == [
        ExpireCold(key(5)), ExpireCold(key(6)), ExpireCold(key(9))]


def test_sweep_respects_tier_health_and_pins():
    c = core()
    c.index.note_stored(key(1), WARM, 10, now=0.0)
    c.index.note_stored(key(2), WARM, 10, now=0.0)
    c.catalog.pin(FP, [key(2).block_hash])
    assert c.maintenance.sweep(now=200.0, warm_up=True, cold_up=False) == [RenewWarm(key(1))]  # cannot archive
    assert c.maintenance.sweep(now=200.0, warm_up=False, cold_up=True) == []
    assert c.maintenance.sweep(now=200.0, warm_up=True, cold_up=True) == [Archive(key(1), cold_has_it=False)]
    c.catalog.unpin(FP, [key(2).block_hash])
    assert c.maintenance.sweep(now=200.0, warm_up=True, cold_up=True) == [
        Archive(key(1), cold_has_it=False), Archive(key(2), cold_has_it=False)]


def test_renewed_lease_is_not_renewed_again_until_due():
    c = core()
    c.index.note_stored(key(1), WARM, 10, now=0.0)
    assert c.maintenance.sweep(now=45.0, warm_up=True, cold_up=True) == [RenewWarm(key(1))]
    c.index.note_renewed(key(1), now=45.0)
    assert c.maintenance.sweep(now=60.0, warm_up=True, cold_up=True) == []
    assert c.maintenance.sweep(now=90.0, warm_up=True, cold_up=True) == [RenewWarm(key(1))]


def test_hits_reset_idle_time():
    c = core(warm_ttl_s=10_000.0)  # no lease renewals in this test
    c.index.note_stored(key(1), WARM, 10, now=0.0)
    c.index.note_hit(key(1), now=90.0)
    assert c.maintenance.sweep(now=150.0, warm_up=True, cold_up=True) == []
    c.worker_events.stored("w1", FP, [key(1).block_hash], seq=0, now=140.0)  # a worker loaded it: a hit
    assert c.maintenance.sweep(now=200.0, warm_up=True, cold_up=True) == []
    assert c.maintenance.sweep(now=240.0, warm_up=True, cold_up=True) == [Archive(key(1), cold_has_it=False)]
