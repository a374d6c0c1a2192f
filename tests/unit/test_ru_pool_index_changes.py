"""What ru-pool replicas tell each other, without a bus (kite_ru_pool.index_changes, the worker-cache
snapshot in worker_caches / core): the change log's grouping and batches, a receiving core applying them,
and a joining replica's worker caches from a snapshot plus the events that came meanwhile. The same over
real processes, NATS and Redis: tests/integration/test_ru_pool_replicas.py."""

from __future__ import annotations

import hashlib

from kite_ru_pool.admin import PoolAdmin
from kite_ru_pool.background import BackgroundTasks
from kite_ru_pool.core import ALL_TAGS, COLD, HOT, WARM, PoolCore
from kite_ru_pool.index_changes import IndexChangeLog, apply_changes
from kite_ru_pool.maintenance import Maintenance
from kite_ru_pool.tier_io import TierIO
from kite_ru_pool.worker_caches import WorkerCaches
from kite_shared.messages import PoolAdminRequest, PoolIndexChanges
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ANONYMOUS_TENANT_TAG, tenant_tag
from kite_shared.tiers.client import TierClient
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


def new_core() -> PoolCore:
    return PoolCore(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=0.0,
                    sweep_interval_s=1.0, has_warm=True, has_cold=True)


def send(log: IndexChangeLog, core: PoolCore, now: float = NOW) -> int:
    """Everything `log` holds, through the wire format, applied to `core`; how many messages."""
    batches = log.take()
    for seq, batch in enumerate(batches, 1):
        msg = PoolIndexChanges.decode(PoolIndexChanges(instance_id="a", seq=seq, changes=batch).encode())
        apply_changes(core, msg.changes, now)
    return len(batches)


# --- the change log ------------------------------------------------------------------------------------------
def test_consecutive_changes_of_one_kind_make_one_group_and_order_is_kept():
    log = IndexChangeLog()
    calls = []
    log.on_change = lambda: calls.append(1)
    for i in range(100):  # one chain's write-throughs
        log.stored(key(i), WARM, 369_000, last_hit=NOW, depth=i)
    log.missing(key(0), WARM)
    log.stored(key(0), COLD, 369_000, last_hit=NOW)  # an archival: cold first, then gone from warm
    log.missing(key(1), WARM)
    log.hits([key(2), key(3)], NOW + 1)
    log.hits([key(4)], NOW + 2)
    assert calls == [1]  # the replica layer schedules one send for all of it
    [batch] = log.take()
    assert [(c.op, c.tier, len(c.block_hashes)) for c in batch] == [
        ("stored", "warm", 100), ("missing", "warm", 1), ("stored", "cold", 1), ("missing", "warm", 1),
        ("hit", "", 3)]
    assert batch[0].depths == list(range(100)) and batch[0].sizes == [369_000] * 100
    assert batch[-1].at == NOW + 2
    assert len(log) == 0 and log.take() == []
    log.renewed(key(5), NOW)
    assert calls == [1, 1]  # a new change in an empty log: another send


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
def test_a_receiver_applies_tier_changes_hits_renewals_and_pins():
    log, b = IndexChangeLog(), new_core()
    b.put_hot(key(9), b"x" * 10, NOW)  # b's own hot-only block: never in a change
    log.stored(key(1), WARM, 100, last_hit=NOW - 50, depth=3)
    log.stored(key(2), WARM, 100, last_hit=NOW)
    log.stored(key(2), COLD, 100, last_hit=NOW)
    log.missing(key(2), WARM)
    log.renewed(key(1), NOW + 5)
    log.hits([key(1)], NOW + 7)
    log.pinned([key(2)])
    send(log, b, now=NOW + 10)
    e1, e2 = b.entry(key(1)), b.entry(key(2))
    assert (e1.tiers, e1.size, e1.depth, e1.last_hit, e1.warm_touch) == (WARM, 100, 3, NOW + 7, NOW + 5)
    assert e2.tiers == COLD and b.is_pinned(key(2))
    assert b.tiers_of(key(9)) == HOT
    assert b.lookup(FP, [h(1)]).warm == 1 and b.lookup(FP, [h(2)]).cold == 1
    assert b.tenant_usage(ANONYMOUS_TENANT_TAG)[ANONYMOUS_TENANT_TAG].num_bytes == 210
    log.unpinned([key(2)])
    log.missing(key(2), COLD)
    send(log, b)
    assert not b.is_pinned(key(2)) and b.entry(key(2)) is None


def test_dropped_blocks_leave_the_receivers_hot_tier_and_pins_too():
    log, b = IndexChangeLog(), new_core()
    b.put_hot(key(1), b"x" * 10, NOW)  # b had promoted it into its own hot tier
    b.note_stored(key(1), WARM, 10, NOW)
    b.pin(FP, [h(1)])
    log.dropped([key(1), key(2)])  # key 2: unknown to b, nothing to do
    send(log, b)
    assert b.entry(key(1)) is None and b.hot_get(key(1), NOW) is None and not b.is_pinned(key(1))


def test_clears_invalidations_and_their_purges_settle_on_the_receiver():
    log, b = IndexChangeLog(), new_core()
    for i in range(3):
        b.note_stored(key(i), WARM, 10, NOW)
    acme = tenant_tag("acme")
    b.note_stored(key(7, tenant=acme), WARM, 10, NOW)
    log.cleared(TAG, acme)
    send(log, b)
    assert b.entry(key(7, tenant=acme)) is None and b.entry(key(0)) is not None
    assert b.pending_tenant_purges == {(TAG, acme)}
    log.purged(TAG, acme)
    log.cleared(TAG)
    send(log, b)
    assert b.pending_tenant_purges == set() and b.pending_purges == {TAG} and b.num_blocks() == 0
    log.purged(TAG)
    log.invalidated(model_tag(FP2))
    log.stored(key(1, fp=FP2), WARM, 10, last_hit=NOW)  # an invalidated model's block is not indexed
    send(log, b)
    assert b.is_invalidated(FP2) and b.entry(key(1, fp=FP2)) is None
    assert b.pending_purges == {model_tag(FP2)}
    log.cleared(None)
    log.purged(ALL_TAGS)
    send(log, b)
    assert ALL_TAGS not in b.pending_purges


# --- two bus-less replicas: what one does through its tier I/O and admin, the other learns -------------------
class Replica:
    def __init__(self) -> None:
        self.core = PoolCore(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=0.0,
                             sweep_interval_s=1.0, has_warm=False, has_cold=False)
        self.changes = IndexChangeLog()
        background = BackgroundTasks()
        tiers = TierClient(None, None)
        self.io = TierIO(self.core, tiers, RU_KEY, lambda: NOW, background, self.changes)
        maintenance = Maintenance(self.core, self.io, tiers, lambda: NOW, background, 1.0)
        self.admin = PoolAdmin(self.core, self.io, maintenance)


def unit(i: int) -> bytes:
    return RecyclableUnit(block_hash=h(i), parent_hash=h(1000 + i), model_fingerprint=FP, block_index=i,
                          num_tokens=16, codec="fp16", shape=(1, 2, 1, 16, 1),
                          payload=bytes(range(64))).encode(key=RU_KEY)


async def test_an_evict_pin_and_clear_through_one_replica_reach_the_others_hot_tier():
    a, b = Replica(), Replica()
    for i in range(4):
        a.io.put_bytes(unit(i))
        b.io.put_bytes(unit(i))  # both hold the chain in their own hot tiers
    assert len(a.changes) == 0  # hot-only puts are no one else's business
    await a.admin.handle(PoolAdminRequest(op="evict", model_fingerprint=FP, block_hashes=[h(3)]))
    await a.admin.handle(PoolAdminRequest(op="pin", model_fingerprint=FP, block_hashes=[h(0)]))
    send(a.changes, b.core)
    assert b.core.lookup(FP, [h(i) for i in range(4)]).hot == 3 and b.core.is_pinned(key(0))
    await a.admin.handle(PoolAdminRequest(op="clear", model_fingerprint=FP))
    send(a.changes, b.core)
    assert b.core.lookup(FP, [h(0)]).pool == 0 and b.core.num_blocks() == 0
    assert b.core.pending_purges == set()  # a's purge finished (nothing stored) and said so


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


def test_events_held_while_the_snapshot_comes_are_replayed_after_it_when_it_lacks_them():
    source, joiner = new_core(), new_core()
    hashes = [h(i) for i in range(6)]
    source.worker_stored("w1", FP, hashes[:3], seq=1, now=NOW)
    source.worker_stored("w2", FP, hashes[:2], seq=1, now=NOW)
    joiner.hold_worker_events()
    # The joiner hears these while it asks; the source applied the first before its snapshot.
    events = [("w1", hashes[3:5], 2), ("w1", hashes[5:], 3), ("w3", hashes[:1], 7)]
    source.worker_stored(events[0][0], FP, events[0][1], seq=events[0][2], now=NOW)
    snapshot, _ = source.workers.export("", 1 << 20)
    for worker, blocks, seq in events:
        joiner.worker_stored(worker, FP, blocks, seq=seq, now=NOW)
    joiner.worker_removed("w2", FP, hashes[1:2], all_blocks=False, seq=2, now=NOW)
    joiner.forget_worker("w9")  # a draining worker the snapshot does not know: harmless
    assert joiner.lookup(FP, hashes).workers == {}  # nothing applied yet
    assert joiner.install_worker_caches([s[:4] for s in snapshot]) == 4  # w1 seq 3, w3, w2's removal, w9
    assert joiner.lookup(FP, hashes).workers == {"w1": 6, "w2": 1, "w3": 1}
    assert joiner.counters.worker_event_gaps == 0
    joiner.worker_stored("w2", FP, hashes[1:3], seq=3, now=NOW)  # flowing as usual again
    assert joiner.lookup(FP, hashes).workers["w2"] == 3


def test_without_a_snapshot_the_held_events_are_all_applied():
    core = new_core()
    core.hold_worker_events()
    core.worker_stored("w1", FP, [h(0), h(1)], seq=5, now=NOW)
    core.worker_alive("w1", NOW + 1)
    assert core.install_worker_caches([]) == 2
    assert core.lookup(FP, [h(0), h(1)]).workers == {"w1": 2}


def test_a_joining_replica_takes_the_models_state_no_listing_holds():
    source, joiner = new_core(), new_core()
    source.model_fingerprint_changed("m", FP)
    source.model_fingerprint_changed("m", FP2)  # FP is invalidated now
    joiner.note_stored(key(1), WARM, 10, NOW)  # its rebuild listed a block of FP before the purge reached it
    joiner.restore_models(*source.models_state())
    assert joiner.is_invalidated(FP) and joiner.entry(key(1)) is None
    assert joiner.pending_purges == set()  # the leader purges, not the joiner
    assert joiner.lookup(FP, [h(1)]).invalidated
    # The current fingerprint came along: the next change invalidates FP2 on the joiner too.
    assert joiner.model_fingerprint_changed("m", "88" * 32) == [model_tag(FP2)]
