"""The compact block index (issue 38: per-tag parallel arrays, interned owners, counted ledgers, a sweep
that walks slots) against the index as it was before (tests/unit/ru_pool_oracle), on seeded random
sequences of stores, misses, hot evictions, hits, renewals, drops, clears, pins, quota evictions and
sweeps, whole and sliced with changes between the slices: every answer and every sweep decision must be
the same."""

from __future__ import annotations

import random

import pytest

from kite_ru_pool import index as new_index
from kite_ru_pool import lifecycle as new_lifecycle
from kite_ru_pool import tenants as new_tenants
from kite_shared.tiers.hot import HotLRU
from kite_shared.tiers.keys import BlockKey, model_tag
from tests.unit.ru_pool_oracle import index as old_index
from tests.unit.ru_pool_oracle import lifecycle as old_lifecycle
from tests.unit.ru_pool_oracle import tenants as old_tenants

HOT, WARM, COLD = new_index.HOT, new_index.WARM, new_index.COLD
FPS = ["11" * 32, "22" * 32, "33" * 32]
TAGS = [model_tag(fp) for fp in FPS]
OWNERS = ["anonymous", "acme", "beta"]
HASHES = [i.to_bytes(2, "big") * 16 for i in range(30)]
TIER_SETS = [HOT, WARM, COLD, HOT | WARM, WARM | COLD, HOT | WARM | COLD]


class Pair:
    """The old and the new index, fed the same calls."""

    def __init__(self, quota: int) -> None:
        self.old = old_index.BlockIndex(old_tenants.Tenants(quota_bytes=quota))
        self.new = new_index.BlockIndex(new_tenants.Tenants(quota_bytes=quota))

    def both(self, method: str, *args, **kw):
        a = getattr(self.old, method)(*args, **kw)
        b = getattr(self.new, method)(*args, **kw)
        return a, b

    def same(self, method: str, *args, **kw):
        a, b = self.both(method, *args, **kw)
        assert a == b, (method, args, kw, a, b)
        return a

    def idents(self) -> set[tuple[str, bytes]]:
        return {(t, h) for t, models in self.old.models.items() for h in models}


def fields(e) -> tuple | None:
    return None if e is None else (e.tiers, e.size, e.last_hit, e.warm_touch, e.tenant_tag, e.depth)


def check_state(p: Pair, rng: random.Random) -> None:
    old = {t: {h: fields(e) for h, e in m.items()} for t, m in p.old.models.items()}
    new = {t: {h: fields(e) for h, e in m.items()} for t, m in p.new.models.items()}
    assert old == new
    assert p.old.num_blocks() == p.new.num_blocks()
    assert p.old.tier_counts() == p.new.tier_counts()
    assert p.old.pins == p.new.pins and p.old.pending_purges == p.new.pending_purges
    for owner in OWNERS:
        a, b = p.old.tenants.usage(owner)[owner], p.new.tenants.usage(owner)[owner]
        assert (len(a.blocks), a.num_bytes, a.quota_evictions, a.quota_refused) == \
               (len(b.blocks), b.num_bytes, b.quota_evictions, b.quota_refused)
        tag = rng.choice([None, *TAGS])
        assert [(t, h, fields(e)) for t, h, e in p.old.tenant_blocks(owner, tag)] == \
               [(t, h, fields(e)) for t, h, e in p.new.tenant_blocks(owner, tag)]
    assert sorted(p.old.tenants.usage()) == sorted(p.new.tenants.usage())
    for _ in range(3):
        tier = rng.choice([HOT, WARM, COLD, WARM | COLD, HOT | WARM | COLD])
        p.same("keys_in", tier, rng.choice([None, *TAGS]), rng.choice([None, *OWNERS]))
        chain = rng.sample(HASHES, rng.randint(0, 12)) if rng.random() < 0.3 else HASHES[:rng.randint(0, 30)]
        p.same("prefixes", rng.choice(TAGS), chain, rng.randrange(8))
        k = random_key(rng)
        assert fields(p.old.entry(k)) == fields(p.new.entry(k))
        p.same("tiers_of", k)
        p.same("keys_of", FPS[TAGS.index(k.model_tag)], rng.sample(HASHES, 4), rng.choice(OWNERS))


def random_key(rng: random.Random) -> BlockKey:
    return BlockKey.of(rng.choice(FPS), rng.choice(HASHES), rng.choice(OWNERS))


def mutate(p: Pair, rng: random.Random, now: float) -> None:
    """One random change, the same to both."""
    op = rng.random()
    k = random_key(rng)
    ident = (k.model_tag, k.block_hash)
    if op < 0.35:
        p.both("note_stored", k, rng.choice([HOT, WARM, COLD]), rng.choice([0, 100, 200, 300]), now,
               last_hit=rng.choice([None, now - rng.randrange(0, 3000, 100)]),
               depth=rng.choice([None, rng.randrange(64)]))
    elif op < 0.45:
        p.same("note_missing", k, rng.choice([HOT, WARM, COLD]))
    elif op < 0.55:
        p.same("note_evicted", k)
        if rng.random() < 0.5:
            p.both("drop_if_empty", k)
    elif op < 0.65:
        p.both("note_hit", k, now - rng.randrange(0, 500, 50))
    elif op < 0.72:
        p.both("note_renewed", k, now - rng.randrange(0, 500, 50))
    elif op < 0.77:
        if p.old.entry(k) is not None:
            assert fields(p.old.drop(*ident)) == fields(p.new.drop(*ident))
    elif op < 0.79:
        p.same("forget_tags", rng.choice([None, *TAGS]))
    elif op < 0.87:
        p.both(rng.choice(["pin", "unpin"]), k)
    else:  # a put over the tenant's quota: its victims, dropped from both
        owner = rng.choice(OWNERS)
        size = rng.choice([100, 300, 2000])
        a = p.old.tenants.quota_victims(owner, size, p.old.evictable(owner, k))
        b = p.new.tenants.quota_victims(owner, size, p.new.evictable(owner, k))
        assert a == b
        assert sorted(p.old.evictable(owner, k)) == sorted(p.new.evictable(owner, k))
        for t, h in a or []:
            assert fields(p.old.drop(t, h)) == fields(p.new.drop(t, h))


def free_slots(index: new_index.BlockIndex) -> int:
    return sum(len(store.hashes) - len(store) for store in index.stores.values())


def passes(p: Pair, rng: random.Random, now: float):
    kw = dict(archive_after_s=rng.choice([100.0, 1000.0]), renew_after_s=rng.choice([50.0, 400.0]),
              cold_ttl_s=rng.choice([0.0, 500.0, 2000.0]), has_cold=rng.random() < 0.8)
    warm_up, cold_up = rng.random() < 0.8, rng.random() < 0.8
    old = old_lifecycle.SweepPass(p.old, HotLRU(1 << 20), now, warm_up, cold_up, **kw)
    new = new_lifecycle.SweepPass(p.new, HotLRU(1 << 20), now, warm_up, cold_up, **kw)
    return old, new


@pytest.mark.parametrize("seed", range(12))
def test_the_compact_index_answers_and_sweeps_exactly_as_the_old_one(seed, monkeypatch):
    rng = random.Random(seed)
    p = Pair(quota=rng.choice([0, 1500, 4000]))
    if seed % 2:  # close the gaps at every pass, to put that path through the same sequences
        monkeypatch.setattr(new_lifecycle, "COMPACT_FREE_FRACTION", 0.0)
    now = 10_000.0
    compacted = False
    for round_ in range(40):
        for _ in range(rng.randint(5, 60)):
            now += rng.choice([0.0, 1.0, 50.0])
            mutate(p, rng, now)
        check_state(p, rng)
        # A whole sweep, then one in slices with no change between them: same decisions, same totals.
        old, new = passes(p, rng, now + rng.choice([0.0, 300.0, 3000.0]))
        free_before = free_slots(p.new)
        assert old.step() and new.step()
        compacted |= free_slots(p.new) < free_before
        free_before = free_slots(p.new)
        assert old.actions() == new.actions() and old.tier_totals() == new.tier_totals()
        assert old.examined == new.examined == p.new.num_blocks()
        old, new = passes(p, rng, now + rng.choice([0.0, 300.0, 3000.0]))
        n = rng.choice([1, 3, 17, 1000])
        while not old.step(n):
            pass
        while not new.step(n):  # (a long run of free slots may end a step early: MAX_WALK_PER_ENTRY)
            pass
        compacted |= free_slots(p.new) < free_before
        assert old.actions() == new.actions() == list(new.ordered_actions())
        assert old.tier_totals() == new.tier_totals() and old.examined == new.examined
        # Sliced with changes between the slices (the service's case): the same steps, the same
        # decisions. Only the cap on free slots walked per step is lifted, which can end a new step
        # earlier than the old one ended (then the two would see the changes at different points).
        with monkeypatch.context() as m:
            m.setattr(new_lifecycle, "MAX_WALK_PER_ENTRY", 10**9)
            old, new = passes(p, rng, now + rng.choice([0.0, 300.0, 3000.0]))
            n = rng.choice([1, 2, 5, 40])
            while True:
                a, b = old.step(n), new.step(n)
                assert a == b and old.examined == new.examined
                if a:
                    break
                for _ in range(rng.randint(0, 4)):
                    now += rng.choice([0.0, 1.0, 50.0])
                    mutate(p, rng, now)
        assert old.actions() == new.actions()
        assert old.tier_totals() == new.tier_totals()
    check_state(p, rng)
    assert compacted or not seed % 2, "no sweep closed a tag's gaps: the test misses that path"


def test_a_block_dropped_and_stored_again_mid_pass_is_examined_where_it_was_and_gaps_close_in_order():
    index = new_index.BlockIndex(new_tenants.Tenants())
    keys = [BlockKey.of(FPS[0], h) for h in HASHES[:8]]
    for k in keys:
        index.note_stored(k, WARM, 10, now=0.0)
    for k in keys[:4]:
        index.note_missing(k, WARM)  # half the slots free: the next pass closes the gaps
    store = index.stores[TAGS[0]]

    def sweep() -> new_lifecycle.SweepPass:
        return new_lifecycle.SweepPass(index, HotLRU(1 << 20), 500.0, True, True, archive_after_s=100.0,
                                       renew_after_s=1000.0, cold_ttl_s=0.0, has_cold=True)
    pass_ = sweep()
    assert not pass_.step(1) and store.hashes[0] == keys[4].block_hash  # moved down, in order
    index.note_missing(keys[6], WARM)  # dropped before the pass reached it ...
    index.note_stored(keys[6], WARM, 10, now=0.0)  # ... and stored again: its slot back
    index.note_stored(keys[0], WARM, 10, now=0.0)  # new since the pass reached the tag: next sweep
    assert pass_.step(10)
    assert [a.key for a in pass_.actions()] == keys[4:8]
    assert store.hashes == [k.block_hash for k in keys[4:8] + keys[:1]]  # packed, arrival order kept
    assert [store.slots[k.block_hash] for k in keys[4:8] + keys[:1]] == list(range(5))
    assert len(store.tiers) == len(store.size) == len(store.tenant) == 5
    assert [a.key for a in sweep().step() and index and new_lifecycle.SweepPass.actions(pass_)] == keys[4:8]


def test_an_index_costs_under_250_bytes_a_block_with_per_put_tenant_strings():
    """What the compact layout keeps per block (tracemalloc): the bench measures it at 10^5 and 10^6."""
    import tracemalloc
    rng = random.Random(3)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = new_index.BlockIndex(new_tenants.Tenants())
    for i in range(20_000):
        key = BlockKey.of(FPS[i % 3], rng.randbytes(32), OWNERS[i % 3].encode().decode())
        index.note_stored(key, WARM, 368_640, now=1e6 + i, last_hit=1e6 + i, depth=i % 128)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert held / index.num_blocks() < 250
