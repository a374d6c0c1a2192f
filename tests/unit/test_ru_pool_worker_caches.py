"""ru-pool worker caches (kite_ru_pool.worker_caches), alone and through PoolCore: each worker's local
cache from its BlockStored/BlockRemoved events, prefix lengths in lookups, event gaps, stale workers."""

from kite_ru_pool.core import PoolCore
from kite_ru_pool.worker_caches import WorkerCaches

FP = "11" * 32
FP2 = "22" * 32
CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=1.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def test_worker_local_caches_from_events():
    c = core()
    c.worker_stored("w1", FP, CHAIN[:6], seq=1, now=1.0)
    c.worker_stored("w2", FP, CHAIN[:2] + CHAIN[3:5], seq=1, now=1.0)
    c.worker_stored("w3", FP2, CHAIN, seq=1, now=1.0)
    c.worker_removed("w1", FP, [CHAIN[4]], all_blocks=False, seq=2, now=2.0)
    r = c.lookup(FP, CHAIN)
    assert r.workers == {"w1": 4, "w2": 2, "w3": 0}
    assert c.lookup(FP, CHAIN, include_workers=False).workers == {}
    c.worker_removed("w2", "", [], all_blocks=True, seq=2, now=3.0)
    assert c.lookup(FP, CHAIN).workers == {"w1": 4, "w3": 0}


def test_worker_event_gaps_are_counted_and_stale_workers_found():
    c = core()
    c.worker_stored("w1", FP, CHAIN[:1], seq=1, now=10.0)
    c.worker_stored("w1", FP, CHAIN[1:2], seq=2, now=10.0)
    assert c.counters.worker_event_gaps == 0
    c.worker_stored("w1", FP, CHAIN[2:3], seq=5, now=10.0)  # 3 and 4 were lost
    assert c.counters.worker_event_gaps == 1
    c.worker_stored("w2", FP, CHAIN[:1], seq=1, now=40.0)
    assert c.stale_workers(now=45.0, after_s=30.0) == ["w1"]
    c.worker_alive("w1", now=44.0)
    assert c.stale_workers(now=45.0, after_s=30.0) == []


def test_worker_caches_alone():
    w = WorkerCaches()
    assert w.stored("w1", "tag", CHAIN[:4], seq=1, now=1.0) is False
    assert w.removed("w1", "tag", CHAIN[1:2], all_blocks=False, seq=3, now=2.0) is True  # 2 was lost
    assert w.stored("w2", "tag", CHAIN[:2], seq=0, now=2.0) is False  # unnumbered: never a gap
    assert w.prefix_lengths("tag", CHAIN) == {"w1": 1, "w2": 2}
    assert w.prefix_lengths("other", CHAIN) == {"w1": 0, "w2": 0}
    assert w.num_blocks() == {"w1": 3, "w2": 2}
    w.forget_tags(["tag"])
    assert w.num_blocks() == {"w1": 0, "w2": 0}
    w.alive("w1", now=50.0)
    w.alive("w9", now=50.0)  # a heartbeat of a worker whose cache is unknown: nothing to keep
    assert w.stale(now=60.0, after_s=30.0) == ["w2"]
    w.removed("w1", "", [], all_blocks=True, seq=4, now=61.0)
    w.forget("w2")
    assert w.num_blocks() == {} and w.stale(now=1000.0, after_s=30.0) == ["w1"]
