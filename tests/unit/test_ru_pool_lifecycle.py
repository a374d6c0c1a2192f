"""ru-pool core lifecycle decisions: demotion, archival, lease renewal, cold TTL, pins (exact order)."""

from kite_ru_pool.core import COLD, HOT, WARM, Archive, Demote, ExpireCold, PoolCore, RenewWarm
from kite_shared.tiers.keys import BlockKey

FP = "33" * 32


def key(i: int) -> BlockKey:
    return BlockKey.of(FP, bytes([i]) * 32)


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=30, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=5.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def test_hot_eviction_demotes_to_warm_only_blocks_no_slower_tier_holds():
    c = core()
    c.put_hot(key(1), b"a" * 10, now=1.0)
    c.put_hot(key(2), b"b" * 10, now=2.0)
    c.put_hot(key(3), b"c" * 10, now=3.0)
    c.note_stored(key(2), WARM, 10, now=3.5)  # write-through of 2 finished, 1's did not
    assert c.put_hot(key(4), b"d" * 10, now=4.0) == [Demote(key(1), b"a" * 10, WARM)]
    assert c.put_hot(key(5), b"e" * 10, now=5.0) == []  # evicts 2, which warm already holds
    assert c.tiers_of(key(2)) == WARM
    assert c.tiers_of(key(1)) == 0  # pending demotion: invisible to lookups until it reports
    assert c.lookup(FP, [key(1).block_hash]).pool == 0
    assert c.counters.hot_evictions == 2


def test_demotion_goes_to_cold_when_warm_is_down_or_off():
    c = core(has_warm=False)
    c.put_hot(key(1), b"a" * 20, now=1.0)
    assert c.put_hot(key(2), b"b" * 20, now=2.0) == [Demote(key(1), b"a" * 20, COLD)]
    c.demotion_failed(key(1))
    assert c.entry(key(1)) is None
    assert c.counters.demotions_failed == 1


def test_sweep_archives_idle_warm_blocks_renews_leases_and_expires_cold_oldest_first():
    c = core()
    # last hits: 5 -> t=10, 6 -> t=20, 7 -> t=50, 8 -> t=880 (cold only), 9 -> t=500 (cold only)
    c.note_stored(key(6), WARM, 10, now=20.0)
    c.note_stored(key(5), WARM | COLD, 10, now=10.0)
    c.note_stored(key(7), WARM, 10, now=50.0)
    c.note_stored(key(8), COLD, 10, now=880.0)
    c.note_stored(key(9), COLD, 10, now=500.0)
    # at t=121: 5 and 6 idle >= 100 -> archive; 7 idle 71 but its lease (60 s, renewed 15 s early)
    # is due -> renew; 9 idle 1000 (not yet: 621); nothing expires
    assert c.sweep(now=121.0, warm_up=True, cold_up=True) == [
        Archive(key(5), cold_has_it=True), Archive(key(6), cold_has_it=False), RenewWarm(key(7))]
    # cold TTL: 9 idle 1000 at t=1500, 8 idle 620
    c.note_missing(key(5), WARM)
    c.note_missing(key(6), WARM)
    c.note_stored(key(6), COLD, 10, now=121.0)
    c.note_missing(key(7), WARM)
    assert c.sweep(now=1500.0, warm_up=True, cold_up=True) == [
        ExpireCold(key(5)), ExpireCold(key(6)), ExpireCold(key(9))]


def test_sweep_respects_tier_health_and_pins():
    c = core()
    c.note_stored(key(1), WARM, 10, now=0.0)
    c.note_stored(key(2), WARM, 10, now=0.0)
    c.pin(FP, [key(2).block_hash])
    assert c.sweep(now=200.0, warm_up=True, cold_up=False) == [RenewWarm(key(1))]  # cannot archive
    assert c.sweep(now=200.0, warm_up=False, cold_up=True) == []
    assert c.sweep(now=200.0, warm_up=True, cold_up=True) == [Archive(key(1), cold_has_it=False)]
    c.unpin(FP, [key(2).block_hash])
    assert c.sweep(now=200.0, warm_up=True, cold_up=True) == [
        Archive(key(1), cold_has_it=False), Archive(key(2), cold_has_it=False)]


def test_renewed_lease_is_not_renewed_again_until_due():
    c = core()
    c.note_stored(key(1), WARM, 10, now=0.0)
    assert c.sweep(now=45.0, warm_up=True, cold_up=True) == [RenewWarm(key(1))]
    c.note_renewed(key(1), now=45.0)
    assert c.sweep(now=60.0, warm_up=True, cold_up=True) == []
    assert c.sweep(now=90.0, warm_up=True, cold_up=True) == [RenewWarm(key(1))]


def test_hits_reset_idle_time():
    c = core(warm_ttl_s=10_000.0)  # no lease renewals in this test
    c.note_stored(key(1), WARM, 10, now=0.0)
    c.note_hit(key(1), now=90.0)
    assert c.sweep(now=150.0, warm_up=True, cold_up=True) == []
    c.worker_stored("w1", FP, [key(1).block_hash], seq=0, now=140.0)  # a worker loaded it: a hit
    assert c.sweep(now=200.0, warm_up=True, cold_up=True) == []
    assert c.sweep(now=240.0, warm_up=True, cold_up=True) == [Archive(key(1), cold_has_it=False)]


def test_pinned_hot_blocks_stay_and_unfit_puts_are_refused():
    c = core()
    c.pin(FP, [key(1).block_hash, key(2).block_hash, key(3).block_hash])
    for i in (1, 2, 3):
        c.put_hot(key(i), bytes([i]) * 10, now=float(i))
    assert c.put_hot(key(4), b"d" * 10, now=4.0) == []
    assert c.counters.hot_refused == 1 and c.tiers_of(key(4)) == 0
    assert all(c.tiers_of(key(i)) == HOT for i in (1, 2, 3))


def test_clear_forgets_everything_and_queues_a_full_purge():
    c = core()
    c.put_hot(key(1), b"a" * 10, now=1.0)
    c.note_stored(key(2), COLD, 10, now=1.0)
    assert c.forget_tag(None) == 2
    assert c.num_blocks() == 0 and len(c.hot) == 0
    assert c.pending_purges == {"*"}
