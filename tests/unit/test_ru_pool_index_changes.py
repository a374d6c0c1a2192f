"""What ru-pool replicas tell each other, without a bus (kite_ru_pool.index_changes, the worker-cache
snapshot in worker_caches): the change log's grouping and batches, and what one bus-less replica's admin
does reaching another's hot tier; the pages of a worker-cache snapshot. A receiving pool applying the
changes: test_ru_pool_catalog.py; the events a joining replica holds meanwhile:
test_ru_pool_worker_events.py. The same over real processes, NATS and Redis:
tests/integration/test_ru_pool_replicas.py."""

from __future__ import annotations

import hashlib

from kite_ru_pool.admin import PoolAdmin
from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, WARM
from kite_ru_pool.index_changes import IndexChangeLog
from kite_ru_pool.worker_caches import WorkerCaches
from kite_shared.messages import PoolAdminRequest, PoolIndexChanges
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ANONYMOUS_TENANT_TAG, tenant_tag
from kite_shared.tiers.keys import BlockKey, model_tag

FP = "66" * 32
FP2 = "77" * 32
TAG = model_tag(FP)
NOW = 1000.0
RU_KEY = b"k" * 32


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def key(i: int, fp: str = FP, tenant: str = ANONYMOUS_TENANT_TAG) -> BlockKey:
    return BlockKey.of(fp, h(i), tenant)


def send(log: IndexChangeLog, core: PoolCore, now: float = NOW) -> int:
    """Everything `log` holds, through the wire format, applied to `core`; how many messages."""
    batches = log.take()
    for seq, batch in enumerate(batches, 1):
        msg = PoolIndexChanges.decode(PoolIndexChanges(instance_id="a", seq=seq, changes=batch).encode())
        core.catalog.apply_changes(msg.changes, now)
    return len(batches)


# --- the change log ------------------------------------------------------------------------------------------
def test_consecutive_changes_of_one_kind_make_one_group_and_order_is_kept():
    log = IndexChangeLog()
    assert not log.pending.is_set()
    for i in range(100):  # one chain's write-throughs
        log.stored(key(i), WARM, 369_000, last_hit=NOW, depth=i)
    log.missing(key(0), WARM)
    log.stored(key(0), COLD, 369_000, last_hit=NOW)  # an archival: cold first, then gone from warm
    log.missing(key(1), WARM)
    log.hits([key(2), key(3)], NOW + 1)
    log.hits([key(4)], NOW + 2)
    assert log.pending.is_set()  # the replica layer sends all of it at once
    [batch] = log.take()
    assert [(c.op, c.tier, len(c.block_hashes)) for c in batch] == [
        ("stored", "warm", 100), ("missing", "warm", 1), ("stored", "cold", 1), ("missing", "warm", 1),
        ("hit", "", 3)]
    assert batch[0].depths == list(range(100)) and batch[0].sizes == [369_000] * 100
    assert batch[-1].at == NOW + 2
    assert len(log) == 0 and not log.pending.is_set() and log.take() == []
    log.renewed(key(5), NOW)
    assert log.pending.is_set()  # a new change in an empty log: another send


def test_groups_split_by_model_tenant_and_a_large_one_over_several_messages():
    log = IndexChangeLog()
    log.dropped([key(1), key(2, tenant=tenant_tag("acme")), key(3, fp=FP2)])
    assert [(c.model_tag, c.tenant_tag) for batch in log.take() for c in batch] == [
        (TAG, ANONYMOUS_TENANT_TAG), (TAG, tenant_tag("acme")), (model_tag(FP2), ANONYMOUS_TENANT_TAG)]
    for i in range(25):
        log.stored(key(i), WARM, 10, last_hit=NOW, depth=i)
    log.cleared(None)
    batches = log.take(max_hashes=10)
    assert [[(c.op, len(c.block_hashes)) for c in b] for b in batches] == [
        [("stored", 10)], [("stored", 10)], [("stored", 5), ("cleared", 0)]]
    assert [d for b in batches for c in b for d in c.depths] == list(range(25))


def test_a_disabled_log_records_nothing():
    log = IndexChangeLog(enabled=False)
    log.stored(key(1), WARM, 10, last_hit=NOW)
    log.dropped([key(1)])
    log.cleared("x")
    assert len(log) == 0 and log.take() == []


# --- applying them -----------------------------------------------------------------------------------------


# --- two bus-less replicas: what one does through its tier I/O and admin, the other learns -------------------
class Replica:
    def __init__(self) -> None:
        self.changes = IndexChangeLog()
        self.core = PoolCore(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=0.0,
                             sweep_interval_s=1.0, has_warm=False, has_cold=False, ru_key=RU_KEY,
                             clock=lambda: NOW, changes=self.changes)
        self.admin = PoolAdmin(self.core)


def unit(i: int) -> bytes:
    return RecyclableUnit(block_hash=h(i), parent_hash=h(1000 + i), model_fingerprint=FP, block_index=i,
                          num_tokens=16, codec="fp16", shape=(1, 2, 1, 16, 1),
                          payload=bytes(range(64))).encode(key=RU_KEY)


async def test_an_evict_pin_and_clear_through_one_replica_reach_the_others_hot_tier():
    a, b = Replica(), Replica()
    for i in range(4):
        a.core.writes.put_bytes(unit(i))
        b.core.writes.put_bytes(unit(i))  # both hold the chain in their own hot tiers
    assert len(a.changes) == 0  # hot-only puts are no one else's business
    await a.admin.handle(PoolAdminRequest(op="evict", model_fingerprint=FP, block_hashes=[h(3)]))
    await a.admin.handle(PoolAdminRequest(op="pin", model_fingerprint=FP, block_hashes=[h(0)]))
    send(a.changes, b.core)
    assert b.core.reads.lookup(FP, [h(i) for i in range(4)]).hot == 3 and b.core.index.is_pinned(key(0))
    await a.admin.handle(PoolAdminRequest(op="clear", model_fingerprint=FP))
    send(a.changes, b.core)
    assert b.core.reads.lookup(FP, [h(0)]).pool == 0 and b.core.index.num_blocks() == 0
    assert b.core.index.pending_purges == set()  # a's purge finished (nothing stored) and said so


# --- worker caches: the snapshot a joining replica takes ------------------------------------------------------
def test_worker_caches_export_pages_of_whole_workers_and_cut_one_too_large_for_a_page():
    w = WorkerCaches()
    for n in range(5):
        w.stored(f"w{n}", TAG, [h(i) for i in range(10 * (n + 1))], seq=n + 1, now=NOW + n)
    page, more = w.export("", max_bytes=40 * 34 + 3 * 96)  # w0 (10) + w1 (20) fit, w2 (30) does not
    assert [p[0] for p in page] == ["w0", "w1"] and more
    page, more = w.export("w1", max_bytes=40 * 34 + 3 * 96)
    assert [p[0] for p in page] == ["w2"] and more
    page, more = w.export("w4", max_bytes=1 << 20)
    assert page == [] and not more
    (worker, seq, seen, models, truncated), = w.export("w3", max_bytes=20 * 34)[0]
    assert (worker, seq, seen, truncated, len(models[TAG])) == ("w4", 5, NOW + 4, True, 20)
    copy = WorkerCaches()
    for worker, seq, seen, models, _ in w.export("", 1 << 20)[0]:
        copy.restore(worker, models, seq, seen)
    chain = [h(i) for i in range(60)]
    assert copy.prefix_lengths(TAG, chain) == w.prefix_lengths(TAG, chain)
    assert copy.stale(NOW + 32, 30) == w.stale(NOW + 32, 30) == ["w0", "w1", "w2"]
