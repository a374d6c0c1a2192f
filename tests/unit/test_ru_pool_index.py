"""ru-pool block index (kite_ru_pool.index), alone and through PoolCore: longest-prefix lookups per tier,
the tenant ledger kept in step, invalidation, dedupe. Worker caches: test_ru_pool_worker_caches.py."""

import time

from kite_ru_pool.core import COLD, HOT, WARM, PoolCore
from kite_ru_pool.index import BlockIndex
from kite_ru_pool.tenants import Tenants
from kite_shared.tiers.keys import BlockKey, model_tag

FP = "11" * 32
FP2 = "22" * 32
CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks


def core(**kw) -> PoolCore:
    args = dict(hot_bytes=1 << 20, archive_after_s=100.0, warm_ttl_s=60.0, cold_ttl_s=1000.0,
                sweep_interval_s=1.0, has_warm=True, has_cold=True)
    args.update(kw)
    return PoolCore(**args)


def store(c: PoolCore, i: int, tier: int, fp: str = FP) -> None:
    c.note_stored(BlockKey.of(fp, CHAIN[i]), tier, 100, now=0.0)


def test_prefix_per_tier_counts_leading_blocks_in_that_tier_only():
    c = core()
    for i in range(5):
        store(c, i, WARM)
    for i in range(3):
        store(c, i, HOT)
    store(c, 3, COLD)
    store(c, 6, COLD)  # after a gap (block 5 is nowhere): not part of any prefix
    store(c, 0, COLD)
    r = c.lookup(FP, CHAIN)
    assert (r.hot, r.warm, r.cold, r.pool) == (3, 5, 1, 5)
    assert r.tiers == b"hhhww"  # cheapest tier of each block of the pool prefix
    assert not r.invalidated


def test_tiers_that_are_down_are_left_out():
    c = core()
    for i in range(4):
        store(c, i, WARM)
    store(c, 0, HOT)
    r = c.lookup(FP, CHAIN, up=HOT | COLD)
    assert (r.hot, r.warm, r.cold, r.pool) == (1, 0, 0, 1)
    assert r.tiers == b"h"


def test_other_models_blocks_do_not_count():
    c = core()
    for i in range(4):
        store(c, i, WARM, fp=FP2)
    r = c.lookup(FP, CHAIN)
    assert (r.hot, r.warm, r.cold, r.pool) == (0, 0, 0, 0)
    assert c.lookup(FP2, CHAIN).warm == 4


def test_new_fingerprint_invalidates_the_old_one_for_lookups_and_puts():
    c = core()
    for i in range(3):
        store(c, i, WARM)
    assert c.model_fingerprint_changed("smollm", FP) == []  # first sighting invalidates nothing
    assert c.model_fingerprint_changed("smollm", FP2) == [model_tag(FP)]
    r = c.lookup(FP, CHAIN)
    assert r.invalidated and r.pool == 0
    assert c.admit_put(BlockKey.of(FP, CHAIN[0])) == "invalidated"
    assert c.keys_in(WARM) == []  # index entries dropped at once
    assert model_tag(FP) in c.pending_purges
    # rolling back to the earlier weights makes them valid again (and the newer ones invalid)
    assert c.model_fingerprint_changed("smollm", FP) == [model_tag(FP2)]
    assert not c.lookup(FP, CHAIN).invalidated
    assert c.lookup(FP2, CHAIN).invalidated


def test_previous_fingerprint_in_the_message_counts_even_if_never_seen():
    c = core()
    assert c.model_fingerprint_changed("m", FP2, previous=FP) == [model_tag(FP)]


def test_put_dedupes_identical_blocks():
    c = core()
    key = BlockKey.of(FP, CHAIN[0])
    assert c.admit_put(key) == "store"
    c.put_hot(key, b"x" * 100, now=1.0)
    assert c.admit_put(key) == "duplicate"
    assert (c.counters.puts, c.counters.duplicates) == (1, 1)


def test_lookup_of_128_blocks_is_fast():
    c = core()
    chain = [i.to_bytes(32, "big") for i in range(128)]
    for h in chain:
        c.note_stored(BlockKey.of(FP, h), WARM | HOT, 369_000, now=0.0)
    for w in range(8):
        c.worker_stored(f"w{w}", FP, chain[:64], seq=0, now=0.0)
    started = time.perf_counter()
    for _ in range(200):
        r = c.lookup(FP, chain)
    per_lookup = (time.perf_counter() - started) / 200
    assert r.pool == 128 and r.workers["w0"] == 64
    assert per_lookup < 0.0005, per_lookup  # the whole budget is 2 ms p99 including NATS


def test_the_index_alone_keeps_the_tenant_ledgers_in_step_and_answers_prefixes():
    tenants = Tenants()
    index = BlockIndex(tenants)
    k0, k1 = (BlockKey.of(FP, CHAIN[i], "t1") for i in range(2))
    index.note_stored(k0, WARM, 100, now=1.0)
    index.note_stored(k0, COLD, 120, now=2.0)  # the same block, another tier (and a corrected size)
    index.note_stored(k1, HOT, 50, now=2.0)
    assert (len(tenants.ledgers["t1"].blocks), tenants.ledgers["t1"].num_bytes) == (2, 170)
    assert index.prefixes(model_tag(FP), CHAIN, HOT | WARM | COLD) == (0, 1, 1, 2, b"wh")
    assert index.prefixes(model_tag(FP), CHAIN, HOT) == (0, 0, 0, 0, b"")
    assert index.note_missing(k1, HOT) == k1  # the owner as the index knows it
    assert index.note_missing(BlockKey.of(FP, CHAIN[5]), HOT) is None
    assert (len(tenants.ledgers["t1"].blocks), tenants.ledgers["t1"].num_bytes) == (1, 120)
    assert index.forget_tags(None) == ([model_tag(FP)], 1)
    assert tenants.ledgers["t1"].num_bytes == 0 and index.pending_purges == {"*"}


def _prefixes_by_definition(index: BlockIndex, tag: str, chain: list[bytes], up: int):
    """prefixes() as its docstring says, block by block (the index's own walk is a tuned version)."""
    def tiers(h: bytes) -> int:
        e = index.models.get(tag, {}).get(h)
        return 0 if e is None else e.tiers & up

    def prefix(keep) -> int:
        n = 0
        while n < len(chain) and keep(tiers(chain[n])):
            n += 1
        return n

    pool = prefix(bool)
    letters = bytes((b"h" if t & HOT else b"w" if t & WARM else b"c")[0] for t in map(tiers, chain[:pool]))
    return (prefix(lambda t: t & HOT), prefix(lambda t: t & WARM), prefix(lambda t: t & COLD), pool, letters)


def test_prefixes_match_their_definition_for_every_mix_of_tiers_gaps_and_tiers_up():
    import random
    rng = random.Random(14)
    chain = [i.to_bytes(32, "big") for i in range(12)]
    for _ in range(300):
        index = BlockIndex(Tenants())
        for h in chain:
            tiers = rng.choice([0, 0, HOT, WARM, COLD, HOT | WARM, WARM | COLD, HOT | COLD, HOT | WARM | COLD])
            if tiers or rng.random() < 0.5:  # no entry at all, or one whose tiers are gone (a demotion pending)
                index.note_stored(BlockKey.of(FP, h), tiers or WARM, 100, now=0.0)
                index.models[model_tag(FP)][h].tiers = tiers
        for up in range(8):
            assert index.prefixes(model_tag(FP), chain, up) == _prefixes_by_definition(index, model_tag(FP), chain, up)
    assert BlockIndex(Tenants()).prefixes(model_tag(FP), chain, HOT | WARM | COLD) == (0, 0, 0, 0, b"")
