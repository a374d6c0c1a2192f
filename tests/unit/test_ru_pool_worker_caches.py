"""ru-pool worker caches (kite_ru_pool.worker_caches) alone: each worker's local cache from its
BlockStored/BlockRemoved events, prefix lengths, event gaps, stale workers. Through the pool's parts:
test_ru_pool_worker_events.py; the snapshot's pages: test_ru_pool_index_changes.py."""

from kite_ru_pool.worker_caches import WorkerCaches

CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks


def test_worker_caches_alone():
    w = WorkerCaches()
    assert w.stored("w1", "tag", CHAIN[:4], seq=1, now=1.0) is False
    assert w.removed("w1", "tag", CHAIN[1:2], all_blocks=False, seq=3, now=2.0) is True  # 2 was lost
    assert w.stored("w2", "tag", CHAIN[:2], seq=0, now=2.0) is False  # unnumbered: never a gap
    assert w.prefix_lengths("tag", CHAIN) == {"w1": 1, "w2": 2}
    assert w.prefix_lengths("other", CHAIN) == {}  # only workers holding the first block are named
    assert w.num_blocks() == {"w1": 3, "w2": 2}
    w.forget_tags(["tag"])
    assert w.num_blocks() == {"w1": 0, "w2": 0}
    w.alive("w1", now=50.0)
    w.alive("w9", now=50.0)  # a heartbeat of a worker whose cache is unknown: nothing to keep
    assert w.stale(now=60.0, after_s=30.0) == ["w2"]
    w.removed("w1", "", [], all_blocks=True, seq=4, now=61.0)
    w.forget("w2")
    assert w.num_blocks() == {} and w.stale(now=1000.0, after_s=30.0) == ["w1"]
