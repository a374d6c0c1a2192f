"""ru-pool tenants (kite_ru_pool.tenants), alone and through the pool's parts (PoolCore: writes' admission
and quota, the catalog's clears and evictions): the per-tenant ledger, quota evictions (exact order) and
refusals, clears."""

from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import COLD, HOT, WARM
from kite_ru_pool.lifecycle import DropBlock
from kite_ru_pool.tenants import QUOTA_EVICT_TO, Tenants
from kite_shared.security import ANONYMOUS_TENANT_TAG, tenant_tag
from kite_shared.tiers.keys import BlockKey

FP = "44" * 32
FP2 = "55" * 32
ACME = tenant_tag("acme")
BETA = tenant_tag("beta")


def key(i: int, tenant: str = ACME, fp: str = FP) -> BlockKey:
    return BlockKey.of(fp, bytes([i]) * 32, tenant)


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=5.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def put(c: PoolCore, k: BlockKey, size: int, now: float, tiers: int = WARM) -> list[DropBlock] | None:
    """What the service does for a put: admit, reserve quota, then the tiers report the writes."""
    assert c.writes.admit_put(k) == "store"
    drops = c.writes.reserve_quota(k, size)
    if drops is not None:
        c.index.note_stored(k, tiers, size, now, last_hit=now)
    return drops


def usage(c: PoolCore, tenant: str) -> tuple[int, int]:
    ledger = c.tenants.usage(tenant)[tenant]
    return len(ledger.blocks), ledger.num_bytes


def test_ledger_counts_each_block_once_whatever_tiers_hold_it():
    c = core()
    c.index.note_stored(key(1), WARM, 100, now=1.0)
    c.index.note_stored(key(1), COLD, 100, now=2.0)  # archived copy: same block
    c.writes.put_hot(key(1), b"x" * 100, now=3.0)  # promoted
    c.index.note_stored(key(2, BETA), WARM, 40, now=1.0)
    assert usage(c, ACME) == (1, 100)
    assert usage(c, BETA) == (1, 40)
    c.index.note_missing(key(1), WARM)
    c.index.note_missing(key(1), HOT)
    assert usage(c, ACME) == (1, 100)  # cold still holds it
    c.index.note_missing(key(1), COLD)
    assert usage(c, ACME) == (0, 0)
    assert c.tenants.usage() == {BETA: c.tenants.usage(BETA)[BETA]}  # empty ledgers are not listed


def test_storage_keys_carry_the_owner_so_lifecycle_actions_address_the_right_object():
    c = core()
    c.index.note_stored(key(1, BETA), WARM, 10, now=0.0, last_hit=0.0)
    assert c.index.keys_in(WARM) == [key(1, BETA)]
    assert c.index.keys_in(WARM, tenant_tag=ACME) == []
    [archive] = c.maintenance.sweep(now=1000.0, warm_up=True, cold_up=True)
    assert archive.key == key(1, BETA)


def test_over_quota_evicts_the_tenants_least_recently_hit_blocks_down_to_the_low_watermark():
    c = core(tenant_quota_bytes=1000)
    for i, last_hit in zip(range(1, 6), (5.0, 1.0, 4.0, 2.0, 3.0)):
        assert put(c, key(i), 200, now=last_hit) == []
    c.index.note_stored(key(9, BETA), WARM, 900, now=0.0, last_hit=0.0)  # another tenant's, older than all
    assert usage(c, ACME) == (5, 1000)
    # 1000 + 200 > 1000: free down to 0.9 * 1000 - 200 = 700 kept, i.e. 300 -> two blocks of 200.
    drops = put(c, key(6), 200, now=6.0)
    assert drops == [DropBlock(key(2), WARM), DropBlock(key(4), WARM)]  # last hits 1.0 and 2.0
    assert usage(c, ACME) == (4, 800)
    assert c.index.tiers_of(key(2)) == 0 and c.index.tiers_of(key(4)) == 0
    assert c.reads.lookup(FP, [key(2).block_hash]).pool == 0
    assert usage(c, BETA) == (1, 900)  # never evicted for acme
    assert c.tenants.usage(ACME)[ACME].quota_evictions == 2
    assert QUOTA_EVICT_TO == 0.9


def test_eviction_ties_break_by_key_and_hot_copies_go_too():
    c = core(tenant_quota_bytes=300)
    for i in (3, 1, 2):
        put(c, key(i), 100, now=1.0)
    c.writes.put_hot(key(1), b"x" * 100, now=1.0)
    drops = put(c, key(4), 100, now=2.0)
    # need 400 - 270 = 130 -> two blocks; same last hit, so key order: 1 then 2
    assert drops == [DropBlock(key(1), WARM), DropBlock(key(2), WARM)]
    assert not c.io.hot.contains(key(1))


def test_pinned_blocks_are_never_evicted_and_a_full_pinned_quota_refuses():
    c = core(tenant_quota_bytes=300)
    for i in (1, 2, 3):
        put(c, key(i), 100, now=float(i))
    c.catalog.pin(FP, [key(1).block_hash, key(2).block_hash], ACME)
    assert put(c, key(4), 100, now=4.0) == [DropBlock(key(3), WARM)]
    c.catalog.pin(FP, [key(4).block_hash], ACME)
    assert put(c, key(5), 100, now=5.0) is None  # 300 pinned: no room
    assert c.index.tiers_of(key(5)) == 0
    assert c.tenants.usage(ACME)[ACME].quota_refused == 1


def test_a_block_larger_than_the_quota_is_refused_without_evicting_anything():
    c = core(tenant_quota_bytes=300)
    put(c, key(1), 100, now=1.0)
    assert c.writes.admit_put(key(2)) == "store"
    assert c.writes.reserve_quota(key(2), 301) is None
    assert usage(c, ACME) == (1, 100)


def test_blocks_being_demoted_are_not_candidates():
    c = core(tenant_quota_bytes=25, hot_bytes=20)
    c.writes.put_hot(key(1), b"a" * 10, now=1.0)
    c.writes.put_hot(key(2), b"b" * 10, now=2.0)
    demotions = c.writes.put_hot(key(3), b"c" * 10, now=3.0)  # evicts 1: pending demotion, no tiers yet
    assert [d.key for d in demotions] == [key(1)]
    assert c.index.entry(key(1)).tiers == 0
    # 30 held + 10 new > 25: free down to int(0.9 * 25) = 22 with the new block, so 18 bytes: 2 and 3 (hot only:
    # nothing to delete below), never 1, whose write to warm is in flight.
    assert c.writes.reserve_quota(key(4), 10) == [DropBlock(key(2), 0), DropBlock(key(3), 0)]
    assert c.index.entry(key(1)) is not None


def test_overrides_and_unlimited_tenants():
    c = core(tenant_quota_bytes=100, tenant_quotas={BETA: 0, ANONYMOUS_TENANT_TAG: 1000})
    quota_of = c.tenants.quota_of
    assert quota_of(ACME) == 100 and quota_of(BETA) == 0 and quota_of(ANONYMOUS_TENANT_TAG) == 1000
    for i in range(1, 20):
        assert put(c, key(i, BETA), 100, now=float(i)) == []  # no quota: never evicts
    assert usage(c, BETA) == (19, 1900)


def test_forget_tenant_drops_only_that_tenants_blocks_pins_included_and_queues_a_purge():
    c = core()
    c.index.note_stored(key(1), WARM | COLD, 10, now=1.0)
    c.index.note_stored(key(2, fp=FP2), COLD, 10, now=1.0)
    c.index.note_stored(key(3, BETA), WARM, 10, now=1.0)
    c.catalog.pin(FP, [key(1).block_hash], ACME)
    drops = c.catalog.forget_tenant(ACME)
    assert drops == [DropBlock(key(1), WARM | COLD), DropBlock(key(2, fp=FP2), COLD)]
    assert not c.index.is_pinned(key(1))
    assert usage(c, ACME) == (0, 0) and usage(c, BETA) == (1, 10)
    assert c.index.pending_tenant_purges == {("*", ACME)}


def test_forget_tenant_of_one_model():
    c = core()
    c.index.note_stored(key(1), WARM, 10, now=1.0)
    c.index.note_stored(key(2, fp=FP2), WARM, 10, now=1.0)
    assert c.catalog.forget_tenant(ACME, tag=key(2, fp=FP2).model_tag) == [DropBlock(key(2, fp=FP2), WARM)]
    assert usage(c, ACME) == (1, 10)


def test_forget_tag_and_invalidation_settle_the_ledgers():
    c = core()
    c.index.note_stored(key(1), WARM, 10, now=1.0)
    c.index.note_stored(key(2, BETA), WARM, 10, now=1.0)
    c.index.note_stored(key(3, BETA, fp=FP2), WARM, 10, now=1.0)
    c.catalog.forget_tag(key(1).model_tag)
    assert usage(c, ACME) == (0, 0) and usage(c, BETA) == (1, 10)


def test_evict_forgets_blocks_pins_and_their_bytes_for_their_owner_only():
    c = core(tenant_quota_bytes=1000)
    for i in (1, 2, 3):
        put(c, key(i), 100, now=float(i), tiers=WARM | COLD)
    c.writes.put_hot(key(1), b"x" * 100, now=4.0)
    put(c, key(9, BETA), 50, now=1.0)
    c.catalog.pin(FP, [key(1).block_hash], ACME)
    unknown = bytes([7]) * 32  # never stored: still named, so storage is checked for it too
    keys, held = c.catalog.evict(FP, [key(1).block_hash, key(2).block_hash, unknown], ACME)
    assert held == 2 and c.counters.evicted == 2
    assert keys == [key(1), key(2), BlockKey.of(FP, unknown, ACME)]
    assert not c.index.is_pinned(key(1)) and not c.io.hot.is_pinned(key(1)) and c.io.hot.peek(key(1)) is None
    assert c.index.tiers_of(key(1)) == c.index.tiers_of(key(2)) == 0
    assert c.reads.lookup(FP, [key(1).block_hash]).pool == 0
    assert c.reads.lookup(FP, [key(3).block_hash]).pool == 1
    assert usage(c, ACME) == (1, 100)  # key(3) only
    assert usage(c, BETA) == (1, 50)
    # The ledger stays exact afterwards: the quota counts only what is left.
    for i in (4, 5, 6, 7, 8, 10, 11, 12):
        assert put(c, key(i), 100, now=10.0 + i) == []
    assert usage(c, ACME) == (9, 900)
    # An evicted block stored again is a new put, not a duplicate.
    assert c.writes.admit_put(key(1)) == "store"


def test_quota_victims_alone_least_recent_then_deepest_then_by_key():
    t = Tenants(quota_bytes=1000, quotas={BETA: 0})
    for i in range(5):
        t.added(ACME, ("m", bytes([i])))
    t.resized(ACME, 1000)
    assert t.quota_victims(BETA, 10**6, iter(())) == []  # no quota: nothing asked
    assert t.quota_victims(ACME, 0, iter(())) == []  # fits as it is: candidates never read
    # (last hit, depth, tag, hash, size): 1.2 and 1.7 share the one-second grain, so the deeper goes
    # first; 0.5 is older than both. 1000 + 100 - 900 = 200 bytes to free: the two oldest by that order.
    candidates = [(1.2, 3, "m", b"\1", 100), (1.7, 5, "m", b"\2", 100), (0.5, 0, "m", b"\3", 100),
                  (9.0, 0, "m", b"\4", 700)]
    assert t.quota_victims(ACME, 100, candidates) == [("m", b"\3"), ("m", b"\2")]
    assert t.ledgers[ACME].quota_evictions == 2
    assert t.quota_victims(ACME, 100, [(0.0, 0, "m", b"\1", 50)]) is None  # not enough to free
    assert t.quota_victims(ACME, 1001, candidates) is None  # larger than the quota itself
    assert t.ledgers[ACME].quota_refused == 2
    t.removed(ACME, ("m", bytes([0])), 200)
    assert t.usage(ACME)[ACME].num_bytes == 800 and len(t.usage()[ACME].blocks) == 4
