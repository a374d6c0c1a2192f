"""ru-pool worker events (kite_ru_pool.worker_events) over the pool's parts: each worker's local cache
from its BlockStored/BlockRemoved events as lookups report it, event gaps, stale workers, and the events
a joining replica holds while another replica's snapshot comes. The worker caches alone:
test_ru_pool_worker_caches.py."""

import hashlib

from kite_ru_pool.core import PoolCore

FP = "11" * 32
FP2 = "22" * 32
CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks
NOW = 1000.0


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=1.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def new_core() -> PoolCore:
    return core(cold_ttl_s=0.0)


def test_worker_local_caches_from_events():
    c = core()
    c.worker_events.stored("w1", FP, CHAIN[:6], seq=1, now=1.0)
    c.worker_events.stored("w2", FP, CHAIN[:2] + CHAIN[3:5], seq=1, now=1.0)
    c.worker_events.stored("w3", FP2, CHAIN, seq=1, now=1.0)
    c.worker_events.removed("w1", FP, [CHAIN[4]], all_blocks=False, seq=2, now=2.0)
    r = c.reads.lookup(FP, CHAIN)
    assert r.workers == {"w1": 4, "w2": 2}  # w3 holds none of this model's chain: not named
    assert c.reads.lookup(FP, CHAIN, include_workers=False).workers == {}
    c.worker_events.removed("w2", "", [], all_blocks=True, seq=2, now=3.0)
    assert c.reads.lookup(FP, CHAIN).workers == {"w1": 4}
    assert c.reads.lookup(FP2, CHAIN).workers == {"w3": 8}


def test_worker_event_gaps_are_counted_and_stale_workers_found():
    c = core()
    c.worker_events.stored("w1", FP, CHAIN[:1], seq=1, now=10.0)
    c.worker_events.stored("w1", FP, CHAIN[1:2], seq=2, now=10.0)
    assert c.counters.worker_event_gaps == 0
    c.worker_events.stored("w1", FP, CHAIN[2:3], seq=5, now=10.0)  # 3 and 4 were lost
    assert c.counters.worker_event_gaps == 1
    c.worker_events.stored("w2", FP, CHAIN[:1], seq=1, now=40.0)
    assert c.workers.stale(now=45.0, after_s=30.0) == ["w1"]
    c.worker_events.alive("w1", now=44.0)
    assert c.workers.stale(now=45.0, after_s=30.0) == []


def test_events_held_while_the_snapshot_comes_are_replayed_after_it_when_it_lacks_them():
    source, joiner = new_core(), new_core()
    hashes = [h(i) for i in range(6)]
    source.worker_events.stored("w1", FP, hashes[:3], seq=1, now=NOW)
    source.worker_events.stored("w2", FP, hashes[:2], seq=1, now=NOW)
    joiner.worker_events.hold()
    # The joiner hears these while it asks; the source applied the first before its snapshot.
    events = [("w1", hashes[3:5], 2), ("w1", hashes[5:], 3), ("w3", hashes[:1], 7)]
    source.worker_events.stored(events[0][0], FP, events[0][1], seq=events[0][2], now=NOW)
    snapshot, _ = source.workers.export("", 1 << 20)
    for worker, blocks, seq in events:
        joiner.worker_events.stored(worker, FP, blocks, seq=seq, now=NOW)
    joiner.worker_events.removed("w2", FP, hashes[1:2], all_blocks=False, seq=2, now=NOW)
    joiner.worker_events.forget("w9")  # a draining worker the snapshot does not know: harmless
    assert joiner.reads.lookup(FP, hashes).workers == {}  # nothing applied yet
    assert joiner.worker_events.install([s[:4] for s in snapshot]) == 4  # w1 seq 3, w3, w2's removal, w9
    assert joiner.reads.lookup(FP, hashes).workers == {"w1": 6, "w2": 1, "w3": 1}
    assert joiner.counters.worker_event_gaps == 0
    joiner.worker_events.stored("w2", FP, hashes[1:3], seq=3, now=NOW)  # flowing as usual again
    assert joiner.reads.lookup(FP, hashes).workers["w2"] == 3


def test_without_a_snapshot_the_held_events_are_all_applied():
    core = new_core()
    core.worker_events.hold()
    core.worker_events.stored("w1", FP, [h(0), h(1)], seq=5, now=NOW)
    core.worker_events.alive("w1", NOW + 1)
    assert core.worker_events.install([]) == 2
    assert core.reads.lookup(FP, [h(0), h(1)]).workers == {"w1": 2}
