"""ru-pool catalog (kite_ru_pool.catalog) over the pool's parts: model fingerprints and invalidation, a
clear, and another replica's index changes applied (the change log itself and its wire form:
test_ru_pool_index_changes.py), including the models' state a joining replica takes. Pins, drops and
tenant clears as the ledgers see them: test_ru_pool_tenants.py."""

from __future__ import annotations

import hashlib

from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import ALL_TAGS, COLD, HOT, WARM
from kite_ru_pool.index_changes import IndexChangeLog
from kite_shared.messages import PoolIndexChanges
from kite_shared.security import ANONYMOUS_TENANT_TAG, tenant_tag
from kite_shared.tiers.keys import BlockKey, model_tag

FP = "66" * 32
FP2 = "77" * 32
TAG = model_tag(FP)
NOW = 1000.0
CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def key(i: int, fp: str = FP, tenant: str = ANONYMOUS_TENANT_TAG) -> BlockKey:
    return BlockKey.of(fp, h(i), tenant)


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=1.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def store(c: PoolCore, i: int, tier: int, fp: str = FP) -> None:
    c.index.note_stored(BlockKey.of(fp, CHAIN[i]), tier, 100, now=0.0)


def new_core() -> PoolCore:
    return core(cold_ttl_s=0.0)


def send(log: IndexChangeLog, core: PoolCore, now: float = NOW) -> int:
    """Everything `log` holds, through the wire format, applied to `core`; how many messages."""
    batches = log.take()
    for seq, batch in enumerate(batches, 1):
        msg = PoolIndexChanges.decode(PoolIndexChanges(instance_id="a", seq=seq, changes=batch).encode())
        core.catalog.apply_changes(msg.changes, now)
    return len(batches)


def test_new_fingerprint_invalidates_the_old_one_for_lookups_and_puts():
    c = core()
    for i in range(3):
        store(c, i, WARM)
    assert c.catalog.model_fingerprint_changed("smollm", FP) == []  # first sighting invalidates nothing
    assert c.catalog.model_fingerprint_changed("smollm", FP2) == [model_tag(FP)]
    r = c.reads.lookup(FP, CHAIN)
    assert r.invalidated and r.pool == 0
    assert c.writes.admit_put(BlockKey.of(FP, CHAIN[0])) == "invalidated"
    assert c.index.keys_in(WARM) == []  # index entries dropped at once
    assert model_tag(FP) in c.index.pending_purges
    # rolling back to the earlier weights makes them valid again (and the newer ones invalid)
    assert c.catalog.model_fingerprint_changed("smollm", FP) == [model_tag(FP2)]
    assert not c.reads.lookup(FP, CHAIN).invalidated
    assert c.reads.lookup(FP2, CHAIN).invalidated


def test_previous_fingerprint_in_the_message_counts_even_if_never_seen():
    c = core()
    assert c.catalog.model_fingerprint_changed("m", FP2, previous=FP) == [model_tag(FP)]


def test_clear_forgets_everything_and_queues_a_full_purge():
    c = core()
    c.writes.put_hot(key(1), b"a" * 10, now=1.0)
    c.index.note_stored(key(2), COLD, 10, now=1.0)
    assert c.catalog.forget_tag(None) == 2
    assert c.index.num_blocks() == 0 and len(c.io.hot) == 0
    assert c.index.pending_purges == {"*"}


def test_a_receiver_applies_tier_changes_hits_renewals_and_pins():
    log, b = IndexChangeLog(), new_core()
    b.writes.put_hot(key(9), b"x" * 10, NOW)  # b's own hot-only block: never in a change
    log.stored(key(1), WARM, 100, last_hit=NOW - 50, depth=3)
    log.stored(key(2), WARM, 100, last_hit=NOW)
    log.stored(key(2), COLD, 100, last_hit=NOW)
    log.missing(key(2), WARM)
    log.renewed(key(1), NOW + 5)
    log.hits([key(1)], NOW + 7)
    log.pinned([key(2)])
    send(log, b, now=NOW + 10)
    e1, e2 = b.index.entry(key(1)), b.index.entry(key(2))
    assert (e1.tiers, e1.size, e1.depth, e1.last_hit, e1.warm_touch) == (WARM, 100, 3, NOW + 7, NOW + 5)
    assert e2.tiers == COLD and b.index.is_pinned(key(2))
    assert b.index.tiers_of(key(9)) == HOT
    assert b.reads.lookup(FP, [h(1)]).warm == 1 and b.reads.lookup(FP, [h(2)]).cold == 1
    assert b.tenants.usage(ANONYMOUS_TENANT_TAG)[ANONYMOUS_TENANT_TAG].num_bytes == 210
    log.unpinned([key(2)])
    log.missing(key(2), COLD)
    send(log, b)
    assert not b.index.is_pinned(key(2)) and b.index.entry(key(2)) is None


def test_dropped_blocks_leave_the_receivers_hot_tier_and_pins_too():
    log, b = IndexChangeLog(), new_core()
    b.writes.put_hot(key(1), b"x" * 10, NOW)  # b had promoted it into its own hot tier
    b.index.note_stored(key(1), WARM, 10, NOW)
    b.catalog.pin(FP, [h(1)])
    log.dropped([key(1), key(2)])  # key 2: unknown to b, nothing to do
    send(log, b)
    assert b.index.entry(key(1)) is None and b.reads.hot_get(key(1), NOW) is None and not b.index.is_pinned(key(1))


def test_clears_invalidations_and_their_purges_settle_on_the_receiver():
    log, b = IndexChangeLog(), new_core()
    for i in range(3):
        b.index.note_stored(key(i), WARM, 10, NOW)
    acme = tenant_tag("acme")
    b.index.note_stored(key(7, tenant=acme), WARM, 10, NOW)
    log.cleared(TAG, acme)
    send(log, b)
    assert b.index.entry(key(7, tenant=acme)) is None and b.index.entry(key(0)) is not None
    assert b.index.pending_tenant_purges == {(TAG, acme)}
    log.purged(TAG, acme)
    log.cleared(TAG)
    send(log, b)
    assert b.index.pending_tenant_purges == set() and b.index.pending_purges == {TAG} and b.index.num_blocks() == 0
    log.purged(TAG)
    log.invalidated(model_tag(FP2))
    log.stored(key(1, fp=FP2), WARM, 10, last_hit=NOW)  # an invalidated model's block is not indexed
    send(log, b)
    assert b.catalog.is_invalidated(FP2) and b.index.entry(key(1, fp=FP2)) is None
    assert b.index.pending_purges == {model_tag(FP2)}
    log.cleared(None)
    log.purged(ALL_TAGS)
    send(log, b)
    assert ALL_TAGS not in b.index.pending_purges


def test_a_joining_replica_takes_the_models_state_no_listing_holds():
    source, joiner = new_core(), new_core()
    source.catalog.model_fingerprint_changed("m", FP)
    source.catalog.model_fingerprint_changed("m", FP2)  # FP is invalidated now
    joiner.index.note_stored(key(1), WARM, 10, NOW)  # its rebuild listed a block of FP before the purge reached it
    joiner.catalog.restore_models(*source.catalog.models_state())
    assert joiner.catalog.is_invalidated(FP) and joiner.index.entry(key(1)) is None
    assert joiner.index.pending_purges == set()  # the leader purges, not the joiner
    assert joiner.reads.lookup(FP, [h(1)]).invalidated
    # The current fingerprint came along: the next change invalidates FP2 on the joiner too.
    assert joiner.catalog.model_fingerprint_changed("m", "88" * 32) == [model_tag(FP2)]
